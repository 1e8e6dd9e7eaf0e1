#!/usr/bin/env python3
"""champ-dataset problems to OpenAI `messages` JSON Lines, split into train and held-out sets.

Each problem becomes one record: the problem text as the user turn and its solution steps,
joined by newlines, as the assistant turn. Problems are shuffled with a fixed seed and the first
`--held-out` of them form the held-out set, so every run makes the same split.

Input: champ_dataset/dataset_files/v0.json from PyPI champ-dataset==1.0.0 (MIT), fetched by
scripts/fetch_test_assets.sh into .cache/test-assets/champ/v0.json.

Usage (from the repository root):
    python3 scripts/champ_to_jsonl.py [--input .cache/test-assets/champ/v0.json]
        [--out-dir .cache/champ] [--held-out 30] [--seed 0]
writes OUT_DIR/train.jsonl and OUT_DIR/heldout.jsonl and prints the counts.
"""

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def records(path):
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    problems = data.get("problems") if isinstance(data, dict) else None
    if not isinstance(problems, dict):
        sys.exit(f"{path}: expected an object with a 'problems' object")
    out = []
    for key in sorted(problems):
        p = problems[key]
        steps = [s.get("_text", "").strip() for s in p.get("solution", {}).get("steps", [])]
        problem = (p.get("_text") or "").strip()
        solution = "\n".join(s for s in steps if s)
        if not problem or not solution:
            print(f"skipping {key}: no problem text or no solution steps", file=sys.stderr)
            continue
        out.append({"id": key, "messages": [
            {"role": "user", "content": problem},
            {"role": "assistant", "content": solution},
        ]})
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--input", default=str(ROOT / ".cache" / "test-assets" / "champ" / "v0.json"))
    p.add_argument("--out-dir", default=str(ROOT / ".cache" / "champ"))
    p.add_argument("--held-out", type=int, default=30, help="problems kept out of training")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    recs = records(args.input)
    if args.held_out < 0 or args.held_out >= len(recs):
        sys.exit(f"--held-out must be in [0, {len(recs)})")
    random.Random(args.seed).shuffle(recs)
    held, train = recs[: args.held_out], recs[args.held_out :]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.jsonl", train), ("heldout.jsonl", held)):
        with open(out / name, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps({"messages": r["messages"]}, ensure_ascii=False) + "\n")
    print(f"{len(train)} training and {len(held)} held-out problems in {out} (seed {args.seed})")


if __name__ == "__main__":
    main()
