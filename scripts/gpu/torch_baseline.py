#!/usr/bin/env python3
"""In-memory PyTorch baseline for `sluice bench train`: the same job trained the ordinary way,
with the whole model, its gradients and its optimizer state held in GPU memory.

    python3 scripts/gpu/torch_baseline.py --preset qwen2.5-1.5b --micro-batch 8 --grad-accum 8 --seq-len 1024

This is the command used for the 1.5B comparison. The model is a randomly initialised Qwen2.5
shape (transformers `Qwen2Config`, SDPA attention) trained the way a careful PyTorch user
trains: fp32 master parameters on the GPU, forward and backward under bf16 autocast, fused
AdamW in fp32 (lr 1e-5, betas (0.9, 0.95), no weight decay), global-norm clipping at 1.0, and
gradient accumulation over --grad-accum micro-batches, each loss scaled by 1 / grad_accum.
`--recompute` turns on Hugging Face gradient checkpointing (non-reentrant).

Tokens are uniformly random. Each row has seq_len + 1 tokens: the inputs are the first seq_len,
the targets the last seq_len. The model is called without `labels` (transformers would shift
them again); the loss is F.cross_entropy on the logits upcast to fp32, meaned over the row's
tokens.

Each optimizer step is timed between torch.cuda.synchronize() calls. Figures per step: loss,
seconds, tokens/s, and model TFLOPS as 6 x params x tokens / step time, params counting every
parameter once (a tied embedding / LM head once, as `sluice bench train` counts them); for a
tied model the figure with the LM head counted a second time is printed beside it. The summary
is the median of steps 3..N (all steps when there are fewer than three), as in `sluice bench
train`, plus peak GPU memory; its last line starts with `summary:`.
"""

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import transformers
from transformers import AutoModelForCausalLM, Qwen2Config

# hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
# tie_word_embeddings: the published Qwen2.5 configs.
PRESETS = {
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2, True),
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, True),
    "qwen2.5-3b": (2048, 11008, 36, 16, 2, True),
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, False),
}
VOCAB = 151936


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen2.5-1.5b")
    p.add_argument("--micro-batch", type=int, default=8, help="rows per micro-batch")
    p.add_argument("--grad-accum", type=int, default=8, help="micro-batches per optimizer step")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--recompute", action="store_true", help="HF gradient checkpointing on")
    p.add_argument("--json", metavar="FILE", help="write per-step records and the summary")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("torch_baseline: no CUDA device (torch.cuda.is_available() is False)")
    hidden, inter, layers, heads, kv_heads, tied = PRESETS[args.preset]
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        tie_word_embeddings=tied, rope_theta=1e6, rms_norm_eps=1e-6,
        max_position_embeddings=32768, use_cache=False,
    )
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"GPU {torch.cuda.get_device_name(0)}")
    print(f"config: {vars(args)}")
    shape = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "tie_word_embeddings",
             "rms_norm_eps", "max_position_embeddings")
    rope = getattr(config, "rope_parameters", None) or {"rope_theta": config.rope_theta}
    print(f"model: {args.preset} {dict((k, getattr(config, k)) for k in shape)} rope {rope}")

    torch.manual_seed(args.seed)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model = model.to(device="cuda", dtype=torch.float32).train()
    if args.recompute:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = sum(p.numel() for p in model.parameters())  # a tied weight is one parameter
    params_head = params + (VOCAB * hidden if tied else 0)
    print(f"params: {params:,} (tied={tied}; with the LM head counted: {params_head:,}), "
          f"attention {model.config._attn_implementation}, recompute {args.recompute}")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0,
                            fused=True)

    gen = torch.Generator(device="cuda").manual_seed(args.seed + 1)
    tokens = args.grad_accum * args.micro_batch * args.seq_len
    records = []
    torch.cuda.reset_peak_memory_stats()
    for step in range(1, args.steps + 1):
        rows = torch.randint(VOCAB, (args.grad_accum, args.micro_batch, args.seq_len + 1),
                             device="cuda", generator=gen)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device="cuda")
        for micro in rows:
            x, y = micro[:, :-1], micro[:, 1:]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=x).logits
            loss = F.cross_entropy(logits.float().view(-1, VOCAB), y.reshape(-1))
            (loss / args.grad_accum).backward()
            loss_sum += loss.detach()
            del logits, loss
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        torch.cuda.synchronize()
        step_s = time.perf_counter() - t0
        r = {
            "step": step,
            "loss": loss_sum.item() / args.grad_accum,
            "grad_norm": norm.item(),
            "step_s": step_s,
            "tokens_per_s": tokens / step_s,
            "model_tflops": 6 * params * tokens / step_s / 1e12,
            "model_tflops_head_counted": 6 * params_head * tokens / step_s / 1e12,
            "peak_gpu_allocated_bytes": torch.cuda.max_memory_allocated(),
        }
        records.append(r)
        print(f"step {step}: loss {r['loss']:.4f}  grad norm {r['grad_norm']:.3f}  "
              f"{step_s:.3f} s  {r['tokens_per_s']:.0f} tokens/s  "
              f"{r['model_tflops']:.1f} TFLOPS ({r['model_tflops_head_counted']:.1f} with the "
              f"LM head counted)  peak {r['peak_gpu_allocated_bytes'] / 2**30:.1f} GiB", flush=True)

    steady = records[2:] if len(records) >= 3 else records
    med = lambda k: statistics.median(r[k] for r in steady)  # noqa: E731
    summary = {
        "steps": f"3..{len(records)}" if len(records) >= 3 else f"1..{len(records)}",
        "step_s": med("step_s"),
        "tokens_per_s": med("tokens_per_s"),
        "model_tflops": med("model_tflops"),
        "model_tflops_head_counted": med("model_tflops_head_counted"),
        "params": params,
        "params_head_counted": params_head,
        "tokens_per_step": tokens,
        "peak_gpu_allocated_bytes": torch.cuda.max_memory_allocated(),
        "peak_gpu_reserved_bytes": torch.cuda.max_memory_reserved(),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__,
                       "gpu": torch.cuda.get_device_name(0), "model": config.to_dict(),
                       "records": records, "summary": summary}, f, indent=2, default=str)
    print(f"summary: {args.preset} mb {args.micro_batch} x ga {args.grad_accum} x seq "
          f"{args.seq_len}, recompute {args.recompute}, median of steps {summary['steps']}: "
          f"{summary['step_s']:.3f} s per step, {summary['tokens_per_s']:.0f} tokens/s, "
          f"{summary['model_tflops']:.1f} TFLOPS by 6 x params x tokens "
          f"({summary['model_tflops_head_counted']:.1f} with the LM head counted), "
          f"peak {summary['peak_gpu_allocated_bytes'] / 2**30:.1f} GiB allocated "
          f"({summary['peak_gpu_reserved_bytes'] / 2**30:.1f} GiB reserved)")


if __name__ == "__main__":
    try:
        main()
    except torch.cuda.OutOfMemoryError as e:
        sys.exit(f"torch_baseline: out of GPU memory (peak allocated "
                 f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB): {str(e).splitlines()[0]}")
