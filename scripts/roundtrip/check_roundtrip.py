#!/usr/bin/env python3
"""Round trip through transformers: a model folder written by Sluice loads with
`from_pretrained` and gives the same logits as Sluice on the same tokens.

Runs `sluice generate --dump-logits` on the folder (Sluice's KV-cached CPU forward), loads the
folder with transformers (CPU, float32, eager attention), runs the same token ids and prints the
largest absolute and relative logit difference. Exits 1 when the relative difference exceeds
--tolerance.

Pinned versions, as for the golden fixtures: torch == 2.11.0, transformers == 5.17.0.

Usage (from the repository root):
    .cache/venv/bin/python scripts/roundtrip/check_roundtrip.py MODEL_DIR [--prompt TEXT]
        [--sluice target/debug/sluice]
    .cache/venv/bin/python scripts/roundtrip/check_roundtrip.py --families OUT_DIR
        # builds a tiny random model of each family, trains it one step with `sluice train`,
        # and checks the exported checkpoints
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
ROOT = Path(__file__).resolve().parents[2]

# Tiny shapes of each family; vocab 2048 matches the tokenizer bundled with the engine.
FAMILIES = {
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
              "tie_word_embeddings": True},
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
              "tie_word_embeddings": False, "use_sliding_window": False},
    "qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "head_dim": 24,
              "tie_word_embeddings": True},
    "mistral": {"model_type": "mistral", "architectures": ["MistralForCausalLM"],
                "sliding_window": 8, "tie_word_embeddings": False},
}
COMMON = {"vocab_size": 2048, "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
          "hidden_act": "silu", "eos_token_id": 2, "bos_token_id": None}

PROMPT = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France, "
          "and 12 + 30 = 42.")


def sluice_logits(sluice, model_dir, prompt):
    from safetensors.numpy import load_file
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "logits.safetensors"
        subprocess.run([sluice, "generate", "--model", str(model_dir), "--prompt", prompt,
                        "--max-new-tokens", "0", "--dump-logits", str(out)], check=True)
        t = load_file(str(out))
    return t["input_ids"], t["logits"]


def check(sluice, model_dir, prompt, tolerance):
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    ids, ours = sluice_logits(sluice, model_dir, prompt)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        theirs = model(torch.tensor(ids[None, :], dtype=torch.long)).logits[0].numpy()
    diff = np.abs(theirs - ours)
    worst = np.unravel_index(np.argmax(diff), diff.shape)
    rel = float(diff.max() / max(np.abs(theirs).max(), 1e-30))
    agree = float((theirs.argmax(-1) == ours.argmax(-1)).mean())
    print(f"{model_dir}: {len(ids)} tokens, max |diff| {diff.max():.3g} at {tuple(map(int, worst))}"
          f" (relative to max |logit| {rel:.3g}), argmax agreement {agree:.0%}")
    return rel <= tolerance


def build_family(sluice, family, out_dir):
    """A random model of `family` written by transformers, trained one step by Sluice; returns
    the folder Sluice exported."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    src = out_dir / f"{family}-init"
    cfg = dict(COMMON, **FAMILIES[family])
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    AutoModelForCausalLM.from_config(config).save_pretrained(src)
    tok = ROOT / "engine" / "assets" / "tiny-tokenizer"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / name, src / name)
    run = out_dir / f"{family}-run"
    subprocess.run([sluice, "train", "--model", str(src), "--data",
                    str(ROOT / "datasets" / "demo-alpaca.jsonl"), "--steps", "1", "--seq-len", "64",
                    "--micro-batch", "1", "--lr", "1e-3", "--out", str(run)], check=True,
                   stdout=subprocess.DEVNULL)
    return run / "final"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model_dir", nargs="?", help="a model folder written by Sluice")
    p.add_argument("--families", metavar="OUT_DIR",
                   help="build, train one step and check a tiny model of each family under OUT_DIR")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--sluice", default=str(ROOT / "target" / "debug" / "sluice"))
    p.add_argument("--tolerance", type=float, default=1e-4,
                   help="largest allowed |diff| relative to the largest |logit|")
    args = p.parse_args()
    if not args.model_dir and not args.families:
        p.error("give MODEL_DIR or --families OUT_DIR")

    ok = True
    if args.model_dir:
        ok &= check(args.sluice, args.model_dir, args.prompt, args.tolerance)
    if args.families:
        out = Path(args.families)
        out.mkdir(parents=True, exist_ok=True)
        for family in FAMILIES:
            ok &= check(args.sluice, build_family(args.sluice, family, out), args.prompt,
                        args.tolerance)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
