#!/usr/bin/env python3
"""Golden fixtures for Sluice's CPU reference, made by PyTorch and Hugging Face transformers.

Pinned versions (those of the GPU test machine); the script refuses to run with others:
    torch == 2.11.0, transformers == 5.17.0  (plus safetensors and numpy, any recent version)

Writes, under tests/golden/ (see tests/golden/README.md for the format):
    <case>/config.json, <case>/model.safetensors   as save_pretrained writes them (f32)
    <case>/fixture.safetensors                     batch, logits, loss, gradients, 5-step trajectory
    adamw/fixture.safetensors                      torch.optim.AdamW on loose tensors, 3 steps

Everything runs on the CPU in float32 with eager attention, one thread and fixed seeds, so a rerun
on the same machine reproduces the files bit for bit.

Usage (from the repository root):
    python -m venv .cache/venv
    .cache/venv/bin/pip install torch==2.11.0 transformers==5.17.0 safetensors numpy
    .cache/venv/bin/python scripts/golden/make_fixtures.py [--out tests/golden]
"""

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

TORCH_VERSION = "2.11.0"
TRANSFORMERS_VERSION = "5.17.0"

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    get_cosine_schedule_with_warmup,
)

SEED = 1234
BATCH, SEQ = 2, 13
PROMPT_TOKENS_ROW0 = 4  # labels[0, :4] = -100: the prompt, not trained
IGNORE_INDEX = -100
INIT_STD = 0.1  # weights ~ N(0, 0.1): logits far from flat
NORM_STD = 0.1  # norm weights ~ 1 + N(0, 0.1): a missing norm shows
BIAS_STD = 0.1  # biases ~ N(0, 0.1): a missing bias shows

# The 5-step trajectory's hyperparameters.
LR = 1e-2
BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1  # on tensors with >= 2 dims; 0 on norms and biases
MAX_GRAD_NORM = 1.0
WARMUP_STEPS = 2
TOTAL_STEPS = 5

COMMON = dict(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=8,
    rms_norm_eps=1e-6,
    max_position_embeddings=64,
    initializer_range=INIT_STD,
    hidden_act="silu",
    bos_token_id=1,
    eos_token_id=2,
)

CASES = {
    "llama": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    "llama-linear": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0),
        ),
    ),
    "qwen2": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    "qwen3": (
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(
            head_dim=12,  # 6 heads x 12 = 72 != hidden 48
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    "mistral": (
        MistralConfig,
        MistralForCausalLM,
        dict(
            sliding_window=5,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
}


def check_versions(allow_other: bool) -> None:
    have = (torch.__version__.split("+")[0], transformers.__version__)
    want = (TORCH_VERSION, TRANSFORMERS_VERSION)
    if have != want:
        msg = f"need torch {want[0]} and transformers {want[1]}, found torch {have[0]} and transformers {have[1]}"
        if not allow_other:
            sys.exit(f"make_fixtures.py: {msg} (pass --allow-other-versions to go on anyway)")
        print(f"warning: {msg}", file=sys.stderr)


def reinit(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Every parameter drawn here, in name order, so the weights do not depend on transformers'
    own init code: norm weights 1 + N(0, 0.1), biases N(0, 0.1), everything else N(0, 0.1)."""
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + NORM_STD * noise)
            elif name.endswith(".bias"):
                p.copy_(BIAS_STD * noise)
            else:
                p.copy_(INIT_STD * noise)


def batch(gen: torch.Generator, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=gen, dtype=torch.int64)
    labels = ids.clone()
    labels[0, :PROMPT_TOKENS_ROW0] = IGNORE_INDEX
    return ids, labels


def param_groups(model: torch.nn.Module) -> list[dict]:
    params = list(model.parameters())  # tied tensors appear once
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def metadata(case: str, config, tied: bool) -> dict[str, str]:
    return {
        "case": case,
        "architecture": type(config).__name__.replace("Config", "ForCausalLM"),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "seed": str(SEED),
        "dtype": "float32",
        "attn_implementation": "eager",
        "tie_word_embeddings": str(tied).lower(),
        "ignore_index": str(IGNORE_INDEX),
        "loss": "mean cross-entropy over positions t with labels[t+1] != ignore_index",
        "steps": str(TOTAL_STEPS),
        "adamw.lr": repr(LR),
        "adamw.beta1": repr(BETAS[0]),
        "adamw.beta2": repr(BETAS[1]),
        "adamw.eps": repr(EPS),
        "adamw.weight_decay": repr(WEIGHT_DECAY),
        "adamw.decay_rule": "weight_decay on tensors with ndim >= 2, 0 on the rest",
        "adamw.implementation": "torch.optim.AdamW(foreach=False)",
        "clip.max_norm": repr(MAX_GRAD_NORM),
        "schedule": "cosine",
        "schedule.warmup_steps": str(WARMUP_STEPS),
        "schedule.total_steps": str(TOTAL_STEPS),
        "schedule.num_cycles": "0.5",
    }


def save_fixture(tensors: dict[str, torch.Tensor], path: Path, meta: dict[str, str]) -> None:
    """save_file, then the header's metadata sorted by key: safetensors writes it from a hash map
    in random order, and sorted it makes a rerun byte-identical (an empty git diff)."""
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata=meta)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data start stays 8-byte aligned, as safetensors pads it
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])


def make_case(out: Path, case: str, seed: int) -> None:
    config_cls, model_cls, extra = CASES[case]
    config = config_cls(**{**COMMON, **extra})
    config._attn_implementation = "eager"
    gen = torch.Generator().manual_seed(seed)
    model = model_cls(config).float().eval()  # eval: no dropout (all dropout is 0 anyway)
    reinit(model, gen)
    tied = bool(config.tie_word_embeddings)
    if tied and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise SystemExit(f"{case}: tie_word_embeddings is set but lm_head is not tied")
    ids, labels = batch(gen, config.vocab_size)

    folder = out / case
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    for extra_file in ("generation_config.json",):
        (folder / extra_file).unlink(missing_ok=True)
    initial = {k: v.clone() for k, v in model.state_dict().items()}

    names = [name for name, _ in model.named_parameters()]
    saved = load_file(folder / "model.safetensors")
    missing = [n for n in names if n not in saved]
    if missing:
        raise SystemExit(f"{case}: parameters not in model.safetensors: {missing}")
    for name, t in saved.items():
        if t.dtype != torch.float32:
            raise SystemExit(f"{case}: {name} saved as {t.dtype}, expected float32")

    tensors: dict[str, torch.Tensor] = {
        "input_ids": ids.to(torch.int32),
        "labels": labels.to(torch.int32),
    }

    # Logits, loss and gradients at the initial weights.
    model.zero_grad(set_to_none=True)
    outputs = model(input_ids=ids, labels=labels)
    outputs.loss.backward()
    tensors["logits"] = outputs.logits.detach().float().contiguous()
    tensors["loss"] = outputs.loss.detach().float().reshape(())
    for name, p in model.named_parameters():
        tensors[f"grad.{name}"] = p.grad.detach().clone().contiguous()

    # The 5-step trajectory from the same initial weights.
    model.load_state_dict(initial)
    opt = torch.optim.AdamW(
        param_groups(model), lr=LR, betas=BETAS, eps=EPS, foreach=False, fused=False
    )
    sched = get_cosine_schedule_with_warmup(opt, WARMUP_STEPS, TOTAL_STEPS)
    losses, norms, lrs = [], [], []
    for _ in range(TOTAL_STEPS):
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        losses.append(loss.item())
        lrs.append(opt.param_groups[0]["lr"])
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM).item())
        opt.step()
        sched.step()
    if not norms[0] > MAX_GRAD_NORM:
        raise SystemExit(f"{case}: clipping is not active on step 1 (norm {norms[0]})")
    tensors["traj.loss"] = torch.tensor(losses, dtype=torch.float32)
    tensors["traj.grad_norm"] = torch.tensor(norms, dtype=torch.float32)
    tensors["traj.lr"] = torch.tensor(lrs, dtype=torch.float32)
    for name, p in model.named_parameters():
        tensors[f"final.{name}"] = p.detach().clone().contiguous()

    meta = metadata(case, config, tied)
    meta["traj.lr_f64"] = json.dumps(lrs)
    save_fixture(tensors, folder / "fixture.safetensors", meta)
    clipped = sum(n > MAX_GRAD_NORM for n in norms)
    print(
        f"{case}: loss {tensors['loss'].item():.6f}, trajectory {[round(x, 5) for x in losses]}, "
        f"grad norms {[round(x, 3) for x in norms]} (clipping active on {clipped} of {TOTAL_STEPS} "
        f"steps, including step 1), {len(names)} parameters"
    )


def make_adamw(out: Path, seed: int) -> None:
    """torch.optim.AdamW alone, on loose tensors whose lengths cover SIMD tails, with a different
    learning rate each step. The rates are decimals whose f32 rounding prints back as the same
    decimal, so a caller holding them as f32 means exactly what torch was given."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"a": (5,), "b": (37,), "c": (40, 75)}
    lrs = [1e-2, 5e-3, 2.5e-3]
    tensors: dict[str, torch.Tensor] = {}
    params = {}
    for key, shape in shapes.items():
        p = torch.randn(shape, generator=gen)
        tensors[f"{key}.p.0"] = p.clone()
        params[key] = torch.nn.Parameter(p)
    groups = [
        {"params": [params["a"]], "weight_decay": 0.0},
        {"params": [params["b"], params["c"]], "weight_decay": WEIGHT_DECAY},
    ]
    opt = torch.optim.AdamW(groups, lr=lrs[0], betas=BETAS, eps=EPS, foreach=False, fused=False)
    for step, lr in enumerate(lrs, start=1):
        for group in opt.param_groups:
            group["lr"] = lr
        for key, p in params.items():
            p.grad = 0.1 * torch.randn(p.shape, generator=gen)
            tensors[f"{key}.grad.{step}"] = p.grad.clone()
        opt.step()
        for key, p in params.items():
            state = opt.state[p]
            tensors[f"{key}.p.{step}"] = p.detach().clone()
            tensors[f"{key}.m.{step}"] = state["exp_avg"].clone()
            tensors[f"{key}.v.{step}"] = state["exp_avg_sq"].clone()
    meta = {
        "torch_version": torch.__version__,
        "seed": str(seed),
        "tensors": "a,b,c",
        "decay": "a=false,b=true,c=true",
        "steps": str(len(lrs)),
        "lr": json.dumps(lrs),
        "adamw.beta1": repr(BETAS[0]),
        "adamw.beta2": repr(BETAS[1]),
        "adamw.eps": repr(EPS),
        "adamw.weight_decay": repr(WEIGHT_DECAY),
        "adamw.implementation": "torch.optim.AdamW(foreach=False)",
    }
    folder = out / "adamw"
    folder.mkdir(parents=True, exist_ok=True)
    save_fixture(tensors, folder / "fixture.safetensors", meta)
    print(f"adamw: {len(tensors)} tensors over {len(lrs)} steps")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "tests" / "golden")
    parser.add_argument("--allow-other-versions", action="store_true")
    args = parser.parse_args()
    check_versions(args.allow_other_versions)
    torch.set_num_threads(1)  # reductions in one fixed order
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    for i, case in enumerate(CASES):
        make_case(args.out, case, SEED + i)
    make_adamw(args.out, SEED + 100)


if __name__ == "__main__":
    main()
