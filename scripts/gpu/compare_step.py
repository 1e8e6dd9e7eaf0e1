#!/usr/bin/env python3
"""Replays step 1 of `sluice bench train --check-dir DIR` in PyTorch/transformers on a GPU and
compares the loss, every unit's gradient norm and every tensor's gradient with Sluice's.

    sluice bench train --preset qwen2.5-3b --seq-len 1024 --micro-batch 8 --grad-accum 8 \\
        --steps 1 --check-dir /tmp/check
    python3 scripts/gpu/compare_step.py /tmp/check

DIR/model is the initial weights in bf16 (exactly the copies Sluice's device computes with),
DIR/batches.json the step's micro-batches, DIR/step1.json Sluice's loss and per-unit gradient
norms before clipping, and DIR/grads/<unit>/model.safetensors every tensor's gradient in f32
(written where Sluice's gradients wait on the device, the planner's choice whenever they fit;
step1.json's `gradients` is null otherwise, and only norms are compared). A norm alone would
pass a gradient that is swapped with another of the same size or permuted within its tensor,
so each tensor is compared as a vector: relative L2 error and cosine similarity. The reference is plain transformers: `from_pretrained` in bfloat16 on
cuda, the standard forward (bf16 logits from `lm_head`, upcast to f32 for the loss as
transformers' own loss does), cross-entropy summed over the trained targets and divided by the
step's trained-token count, one backward per micro-batch. Each parameter's bf16 gradient is
added into an f32 buffer after every micro-batch (Sluice accumulates in f32 on the device), so
the comparison is not limited by bf16 accumulation across micro-batches.

Units are Sluice's: the embedding (with a tied LM head's gradient, which is the same tensor in
transformers), each decoder layer, and the head (final norm, plus lm_head when untied). The
tensors of each unit come from step1.json, by their Hugging Face names. transformers 5 holds a
Mixtral or Qwen MoE layer's experts as fused parameters (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`, the router as `mlp.gate`) where the checkpoint, and so step1.json,
names one tensor per expert: such a parameter belongs to the unit of its layer, and a unit's
norm sums whatever parameters belong to it, so the comparison is the same.

Each tensor is judged against the exact gradient, not against PyTorch's bf16 one: the step is
replayed a second time in float32 (the same bf16-valued weights, upcast; f32 activations and
matmuls, rows in small chunks and each gradient moved to host memory as soon as it is complete,
so that a 7B model fits an 80 GB GPU), and Sluice's gradient must be as close to that as
plain bf16 PyTorch's is (see EXACT_FACTOR). At random initialisation bf16 noise alone puts both
several percent away from the exact gradient in every tensor (the per-token gradients barely
add up coherently, so their relative rounding noise survives the sum), which makes a fixed
tolerance against PyTorch's bf16 gradient either too loose to mean much or failing on noise.
`--no-exact` skips the f32 replay and applies TENSOR_REL_L2 and TENSOR_COS_MIN to the bf16
comparison instead.

Exit status 1 when the loss, any unit's norm or any tensor differs by more than the tolerance
(see LOSS_RTOL, NORM_RTOL, EXACT_FACTOR, TENSOR_REL_L2 and TENSOR_COS_MIN), 2 for bad input.
"""

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

# Tolerances, relative to the PyTorch figure.
#
# Both sides compute with the same bf16 weights and bf16 activations and differ only in where
# they round: transformers rounds the logits, the residual stream after each add, the attention
# output and each micro-batch's weight gradient to bf16, Sluice keeps f32 in its reductions and
# accumulators. One bf16 rounding is a relative error of at most 2^-9 (round to nearest, 8
# significant bits), about 2e-3, and these errors are unbiased and independent across elements.
#
# LOSS_RTOL: the loss is a mean over every trained token (65,536 at 64 x 1024) of a log-softmax
# over the vocabulary; independent per-token errors of ~1e-3 average down by sqrt(tokens), so
# anything beyond one bf16 rounding of the loss itself (2e-3) is a real difference.
LOSS_RTOL = 2e-3
# NORM_RTOL: a unit's gradient norm sums millions of squared elements, so elementwise rounding
# noise largely cancels; what does not cancel is the drift of the activation gradient as it is
# rounded again in every layer it flows down through (36 layers for Qwen2.5-3B). With a few
# bf16 roundings per layer compounding as a random walk, the bottom layer's gradient carries
# up to about sqrt(36 x 4) x 2e-3 = 2.4e-2 of relative noise elementwise, and much less in its
# norm. 2e-2 admits that and still catches any real error: a wrong scale, a missing term, a
# mis-ordered tensor or a wrong unit assignment moves a norm by far more than 2%.
NORM_RTOL = 2e-2
# TENSOR_REL_L2: ||ours - theirs|| / ||theirs|| per tensor. The elementwise noise above (up to
# about 2.4e-2 relative at the bottom layer, unbiased) gives a relative L2 error of the same
# order, since the error vector's norm is the RMS of the elementwise errors scaled by the
# tensor's norm; 5e-2 leaves a factor of two. A permuted or swapped gradient of the same norm
# is off by about sqrt(2) (uncorrelated vectors), a sign error by 2, a 10% scale error by 0.1.
# That estimate holds for a trained model's coherent gradients; at random initialisation the
# per-token gradients barely add up, their noise survives the sum, and Qwen2.5-7B at 64 x 1024
# measured 8-9% in every tensor, for bf16 PyTorch and Sluice alike, against the f32 replay.
# So by default this is only the floor of the exact comparison (see EXACT_FACTOR); with
# `--no-exact` it is the bound against bf16 PyTorch.
TENSOR_REL_L2 = 5e-2
# TENSOR_COS_MIN: with noise e orthogonal to the gradient, cos = 1 / sqrt(1 + e^2), about
# 1 - e^2 / 2: 0.9988 at e = 5e-2. 0.998 matches that; a permutation gives about 0.
TENSOR_COS_MIN = 0.998
# EXACT_FACTOR: against the f32 replay, Sluice's relative L2 error per tensor may be at most this
# times bf16 PyTorch's (or TENSOR_REL_L2, whichever is larger). Both errors are bf16 rounding
# noise of the same kind and size; Sluice rounds in fewer places (f32 reductions and
# accumulators), so it should not be farther from exact, and a factor of 2 covers one noise draw
# against another. A swapped, permuted or sign-flipped gradient is off by sqrt(2) to 2 relative
# to the exact one, far beyond twice any bf16 error seen at random initialisation (<= 0.3 for
# the rare tensors whose exact gradient is a near-cancellation, such as a key bias under RoPE).
EXACT_FACTOR = 2.0
# Rows per forward and backward in the f32 replay: one row of 1024 tokens of a 7B model needs
# about 15 GB of f32 activations, beside the f32 weights and gradients (2 x 4 bytes per parameter).
EXACT_ROWS = 1


def bad_input(message: str):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def load_inputs(d: Path):
    for name in ("model/config.json", "batches.json", "step1.json"):
        if not (d / name).is_file():
            bad_input(f"{d / name} is missing; run `sluice bench train ... --check-dir {d}`")
    batches = json.loads((d / "batches.json").read_text())["micro_batches"]
    step = json.loads((d / "step1.json").read_text())
    if not batches:
        bad_input("batches.json holds no micro-batch")
    return batches, step


def load_model(d: Path, torch, device: str, dtype=None):
    from transformers import AutoModelForCausalLM

    dtype = dtype or torch.bfloat16
    try:
        model = AutoModelForCausalLM.from_pretrained(d / "model", dtype=dtype)
    except TypeError:
        # transformers before 4.56 names the argument torch_dtype.
        model = AutoModelForCausalLM.from_pretrained(d / "model", torch_dtype=dtype)
    model.to(device)
    model.config.use_cache = False
    # Dropout is 0 in these configs; train() only makes that explicit where it is not.
    model.train()
    check_rope(d, model, torch, device)
    return model


def check_rope(d: Path, model, torch, device: str):
    """The rotary frequencies must be the ones config.json asks for: a transformers version that
    read another rope_theta would compare a different model."""
    cfg = json.loads((d / "model/config.json").read_text())
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta"))
    rotary = getattr(model.model, "rotary_emb", None)
    kind = (cfg.get("rope_parameters") or {}).get("rope_type", "default")
    if theta is None or rotary is None or cfg.get("rope_scaling") or kind != "default":
        # Scaled RoPE (YaRN, llama3, ...) rescales the frequencies: nothing simple to compare.
        return
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    want = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd))
    have = rotary.inv_freq.float()
    if not torch.allclose(have, want, rtol=1e-5):
        bad_input(f"transformers built rotary frequencies for another rope_theta than {theta}")


def chunk_loss(model, mb, rows: slice, trained_total: int, torch, device: str):
    """Forward and backward of rows `rows` of micro-batch `mb`; returns their summed loss."""
    import torch.nn.functional as F

    n, s = mb["rows"], mb["seq_len"]
    as_tensor = lambda k: torch.tensor(mb[k], dtype=torch.long, device=device).view(n, s)[rows]
    ids, targets, positions = as_tensor("ids"), as_tensor("targets"), as_tensor("positions")
    hidden = model.model(input_ids=ids, position_ids=positions).last_hidden_state
    logits = model.lm_head(hidden)
    loss = F.cross_entropy(
        logits.float().view(-1, logits.shape[-1]),
        targets.reshape(-1),
        ignore_index=-100,
        reduction="sum",
    )
    (loss / trained_total).backward()
    return loss.item()


def replay(model, batches, trained_total: int, torch, device: str):
    """Runs every micro-batch forward and backward; returns the summed loss and the f32
    gradients by parameter name."""
    params = dict(model.named_parameters())
    acc = {n: torch.zeros(p.shape, dtype=torch.float32, device=device) for n, p in params.items()}
    loss_sum = 0.0
    for i, mb in enumerate(batches):
        loss_sum += chunk_loss(model, mb, slice(None), trained_total, torch, device)
        for n, p in params.items():
            if p.grad is not None:
                acc[n] += p.grad.float()
                p.grad = None
        print(f"  micro-batch {i + 1}/{len(batches)}", flush=True)
    return loss_sum, acc


def replay_exact(model, batches, trained_total: int, torch, device: str):
    """The same step in f32, EXACT_ROWS rows at a time (the loss is a sum over tokens, so
    chunking changes nothing but the order of f32 additions); returns the summed loss and the
    gradients by name, in host memory on a GPU (see below), else in the parameters' `.grad`."""
    on_host, hooks = {}, []
    if device.startswith("cuda"):
        # A 7B model's f32 gradients (30 GB) beside its f32 weights (30 GB) and one row's
        # activations (15 GB) overflow an 80 GB GPU: each parameter's gradient moves to host
        # memory as soon as a backward has accumulated it, and is added there. It travels
        # through one pinned buffer sized for the largest parameter, so that only the first row
        # allocates host memory: copying into fresh pageable memory at every row took 20 s or
        # more a row at 7B, the pinned buffer 2.3 s (on the H100 machine).
        largest = max(p.numel() for p in model.parameters())
        stage = torch.empty(largest, dtype=torch.float32, pin_memory=True)

        def to_host(p, name):
            buf = stage[:p.grad.numel()].view(p.grad.shape)
            buf.copy_(p.grad)
            if name in on_host:
                on_host[name] += buf
            else:
                on_host[name] = buf.clone()
            p.grad = None

        for name, p in model.named_parameters():
            hooks.append(p.register_post_accumulate_grad_hook(
                lambda p, name=name: to_host(p, name)))
    loss_sum = 0.0
    for mb in batches:
        for r in range(0, mb["rows"], EXACT_ROWS):
            rows = slice(r, r + EXACT_ROWS)
            started = time.time()
            loss_sum += chunk_loss(model, mb, rows, trained_total, torch, device)
            print(f"  rows {r + 1}..{min(r + EXACT_ROWS, mb['rows'])} of a micro-batch in "
                  f"{time.time() - started:.1f} s", flush=True)
    for h in hooks:
        h.remove()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    grads.update(on_host)
    return loss_sum, grads


def vector_error(ours, theirs):
    """(relative L2 error of `ours` against `theirs`, cosine between them)."""
    a, b = ours.double().flatten(), theirs.double().flatten()
    nb = float(b.norm())
    err = float((a - b).norm())
    r = err / nb if nb > 0 else (0.0 if err == 0 else math.inf)
    na = float(a.norm())
    cos = float(a @ b) / (na * nb) if na > 0 and nb > 0 else (1.0 if na == nb else 0.0)
    return r, cos


def compare_tensors(d: Path, step, grads, exact, torch, device: str):
    """Every tensor Sluice wrote against PyTorch's bf16 gradient of the parameter of the same
    name and, when `exact` is given, both against the f32 one; returns (rows, names not
    compared), a row being (name, rel L2 vs bf16, cosine vs bf16, Sluice's rel L2 vs f32,
    PyTorch bf16's rel L2 vs f32), the last two None without `exact`."""
    from safetensors import safe_open

    rows, skipped = [], []
    for folder in sorted((d / step["gradients"]).iterdir()):
        with safe_open(folder / "model.safetensors", framework="pt", device=device) as f:
            for name in f.keys():
                theirs = grads.get(name)
                ours = f.get_tensor(name)
                if theirs is None or theirs.shape != ours.shape:
                    # A MoE layer's per-expert tensors against transformers' fused parameter:
                    # the unit norms cover them.
                    skipped.append(name)
                    continue
                theirs = theirs.to(device)
                r, cos = vector_error(ours, theirs)
                ours_exact = torch_exact = None
                if exact is not None:
                    want = exact[name].to(device)
                    ours_exact, _ = vector_error(ours, want)
                    torch_exact, _ = vector_error(theirs, want)
                rows.append((name, r, cos, ours_exact, torch_exact))
    return rows, skipped


def exact_gradients(d: Path, grads, batches, trained: int, torch, device: str):
    """Moves bf16 PyTorch's gradients to host memory and replays the step in f32 (the caller
    has dropped the bf16 model); returns the f32 gradients by name."""
    for name in grads:
        grads[name] = grads[name].cpu()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    started = time.time()
    exact_model = load_model(d, torch, device, dtype=torch.float32)
    loss_sum, exact = replay_exact(exact_model, batches, trained, torch, device)
    print(f"f32 replay in {time.time() - started:.1f} s: loss {loss_sum / trained:.6f}")
    return exact


def judge_exact(rows, args):
    """Failures of the tensors whose distance to the f32 gradient exceeds EXACT_FACTOR times
    bf16 PyTorch's (or TENSOR_REL_L2); prints the worst cases per layer depth."""
    failures = []
    ratios = []
    for name, _, _, ours, theirs in rows:
        bound = max(args.tensor_rel_l2, args.exact_factor * theirs)
        ratios.append((ours / theirs if theirs > 0 else 0.0, name, ours, theirs))
        if not ours <= bound:
            failures.append(f"{name}: {ours:.2e} from the f32 gradient where bf16 PyTorch is "
                            f"{theirs:.2e} (bound {bound:.2e})")
    ours_max = max(rows, key=lambda x: x[3])
    theirs_max = max(rows, key=lambda x: x[4])
    ratios.sort(reverse=True)
    mean_ours = sum(r[3] for r in rows) / len(rows)
    mean_theirs = sum(r[4] for r in rows) / len(rows)
    print(f"against the f32 replay (relative L2 error): Sluice mean {mean_ours:.2e}, largest "
          f"{ours_max[3]:.2e} ({ours_max[0]}); bf16 PyTorch mean {mean_theirs:.2e}, largest "
          f"{theirs_max[4]:.2e} ({theirs_max[0]})")
    print("largest ratios Sluice / bf16 PyTorch: " + ", ".join(
        f"{name} {ratio:.2f} ({ours:.2e} / {theirs:.2e})"
        for ratio, name, ours, theirs in ratios[:5]))
    print(f"tolerance: Sluice within max({args.tensor_rel_l2:.0e}, {args.exact_factor} x bf16 "
          f"PyTorch's error) of the f32 gradient")
    return failures


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b != 0 else (0.0 if a == 0 else math.inf)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path, help="the folder written by --check-dir")
    ap.add_argument("--loss-rtol", type=float, default=LOSS_RTOL)
    ap.add_argument("--norm-rtol", type=float, default=NORM_RTOL)
    ap.add_argument("--tensor-rel-l2", type=float, default=TENSOR_REL_L2)
    ap.add_argument("--tensor-cos-min", type=float, default=TENSOR_COS_MIN)
    ap.add_argument("--exact-factor", type=float, default=EXACT_FACTOR)
    ap.add_argument("--no-exact", action="store_true",
                    help="skip the f32 replay; judge tensors against bf16 PyTorch with "
                         "--tensor-rel-l2 and --tensor-cos-min")
    ap.add_argument("--device", default="cuda",
                    help="torch device (cpu only as a smoke test of this script: Sluice's CPU "
                         "backend computes in f32, not with the bf16 copies)")
    args = ap.parse_args()

    batches, step = load_inputs(args.dir)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        bad_input("no CUDA device for PyTorch")
    trained = sum(1 for mb in batches for t in mb["targets"] if t != -100)
    if trained != step["trained_tokens"]:
        bad_input(f"batches.json trains {trained} tokens, step1.json says {step['trained_tokens']}")

    started = time.time()
    model = load_model(args.dir, torch, args.device)
    print(f"loaded {args.dir / 'model'} in {time.time() - started:.1f} s; "
          f"{len(batches)} micro-batches of {batches[0]['rows']} x {batches[0]['seq_len']} tokens")
    started = time.time()
    loss_sum, grads = replay(model, batches, trained, torch, args.device)
    print(f"replayed in {time.time() - started:.1f} s")

    units = step["units"]
    unit_of = {t: u["name"] for u in units for t in u["tensors"]}
    layer_unit = {}
    for u in units:
        for t in u["tensors"]:
            m = re.match(r"model\.layers\.(\d+)\.", t)
            if m:
                layer_unit[m.group(1)] = u["name"]

    def owner(name: str):
        """The unit a transformers parameter belongs to: by name, or, for a layer's fused
        experts, by its layer."""
        if name in unit_of:
            return unit_of[name]
        m = re.match(r"model\.layers\.(\d+)\.mlp\.(experts\.|gate\.)", name)
        return layer_unit.get(m.group(1)) if m else None

    missing = sorted(n for n in grads if owner(n) is None)
    fused_layers = {re.match(r"model\.layers\.(\d+)\.", n).group(1)
                    for n in grads if n not in unit_of and owner(n) is not None}
    unknown = sorted(t for t in unit_of if t not in grads
                     and not any(t.startswith(f"model.layers.{l}.") for l in fused_layers))
    if missing or unknown:
        bad_input(f"units do not match the model's parameters: "
                  f"unassigned {missing[:5]}, not in the model {unknown[:5]}")
    members = {u["name"]: [n for n in grads if owner(n) == u["name"]] for u in units}

    failures = []
    torch_loss = loss_sum / trained
    loss_rel = rel(step["loss"], torch_loss)
    print(f"\n{'':<12} {'sluice':>14} {'pytorch':>14} {'rel diff':>10}")
    print(f"{'loss':<12} {step['loss']:>14.6f} {torch_loss:>14.6f} {loss_rel:>10.2e}")
    if not loss_rel <= args.loss_rtol:
        failures.append(f"loss differs by {loss_rel:.2e} (tolerance {args.loss_rtol:.0e})")
    total_sq = 0.0
    worst = (0.0, "")
    for u in units:
        sq = sum(float(grads[t].double().pow(2).sum()) for t in members[u["name"]])
        total_sq += sq
        ours, theirs = u["grad_norm"], math.sqrt(sq)
        r = rel(ours, theirs)
        worst = max(worst, (r, u["name"]))
        print(f"{u['name']:<12} {ours:>14.6e} {theirs:>14.6e} {r:>10.2e}")
        if not r <= args.norm_rtol:
            failures.append(f"{u['name']}: gradient norm differs by {r:.2e} (tolerance {args.norm_rtol:.0e})")
    theirs = math.sqrt(total_sq)
    print(f"{'global norm':<12} {step['grad_norm']:>14.6e} {theirs:>14.6e} "
          f"{rel(step['grad_norm'], theirs):>10.2e}")
    print(f"\nlargest unit difference: {worst[0]:.2e} ({worst[1]}); "
          f"tolerances: loss {args.loss_rtol:.0e}, norms {args.norm_rtol:.0e}")
    what = "loss and every unit's gradient norm"
    if step.get("gradients"):
        exact = None
        if not args.no_exact:
            del model
            exact = exact_gradients(args.dir, grads, batches, trained, torch, args.device)
        rows, skipped = compare_tensors(args.dir, step, grads, exact, torch, args.device)
        if not rows:
            bad_input(f"{args.dir / step['gradients']} holds no tensor PyTorch has")
        worst_r = max(rows, key=lambda x: x[1])
        worst_c = min(rows, key=lambda x: x[2])
        print(f"tensors: {len(rows)} compared ({len(skipped)} per-expert tensors covered by "
              f"their unit's norm only); against bf16 PyTorch: largest relative L2 error "
              f"{worst_r[1]:.2e} ({worst_r[0]}), smallest cosine {worst_c[2]:.6f} ({worst_c[0]})")
        if exact is None:
            for name, r, cos, _, _ in rows:
                if not (r <= args.tensor_rel_l2 and cos >= args.tensor_cos_min):
                    failures.append(f"{name}: relative L2 error {r:.2e}, cosine {cos:.6f}")
            print(f"tolerances against bf16 PyTorch: {args.tensor_rel_l2:.0e}, "
                  f"{args.tensor_cos_min}")
        else:
            failures += judge_exact(rows, args)
        what += ", and every tensor's gradient,"
    else:
        print("tensors: not compared (Sluice's gradients did not wait on the device)")
    if failures:
        print(f"FAIL ({len(failures)}): " + "; ".join(failures[:10]))
        return 1
    print(f"PASS: {what} match within bf16 tolerance")
    return 0


if __name__ == "__main__":
    sys.exit(main())
