#!/usr/bin/env python3
"""The labelling fine-tune of engine/tests/finetune_task.rs in plain PyTorch and transformers,
for setting Sluice's tuned accuracy beside an ordinary training loop's.

    python3 scripts/gpu/finetune_torch.py --model DIR --data-dir DIR [--steps 14]

--model is a Hugging Face folder (here SmolLM2-135M-Instruct as `sluice import-gguf` writes
it, so both trainers start from the same weights). The script first writes the task's data
into --data-dir (train.jsonl, held_out.jsonl: the same reviews the Rust test builds, so
`sluice train` can be pointed at the same files), then:

- renders each conversation with the tokenizer's chat template (transformers'
  `apply_chat_template`), training only the assistant's reply: the tokens after the prompt
  rendered with `add_generation_prompt=True`, as Sluice's loss mask does;
- groups the shuffled records into steps the way Sluice packs them: rows of at most
  --seq-len tokens (a record never crosses a row), --micro-batch rows a step, wrapping around
  the data. Each record is its own padded sequence here; Sluice packs a row's records with
  attention kept inside each one, which is the same computation;
- trains with fp32 weights under bf16 autocast, AdamW (torch defaults: betas 0.9/0.999, eps
  1e-8, no weight decay) at --lr with transformers' constant schedule after --warmup linear
  steps, global-norm clipping at 1.0, the loss the mean over the step's trained tokens;
- evaluates the held-out prompts by greedy generation of at most --max-new-tokens tokens
  before step 1 and after the last, scored by exact match after SQuAD normalisation (lower
  case, punctuation and articles removed), as Sluice's `exact_match`.

Its last line is a JSON summary: the base and tuned exact match and each answer.
"""

import argparse
import json
import random
import string
import time
import unicodedata
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, get_constant_schedule_with_warmup

# As in engine/tests/finetune_task.rs: the first TRAINED adjectives of each side are trained
# on, the rest held out.
POSITIVE = ["wonderful", "great", "excellent", "delightful", "fantastic", "superb", "lovely",
            "brilliant", "amazing", "charming", "enjoyable", "marvelous", "outstanding",
            "terrific", "pleasant", "splendid", "magnificent", "fabulous"]
NEGATIVE = ["terrible", "awful", "horrible", "dreadful", "boring", "disappointing", "bad", "poor",
            "unpleasant", "miserable", "annoying", "mediocre", "atrocious", "dull", "lousy",
            "painful", "pathetic", "frustrating"]
NOUNS = ["movie", "meal", "hotel", "concert", "book", "service", "trip", "game"]
TRAINED = 12


def review(noun, adjective, good):
    verdict = "verdict: thumbs-up" if good else "verdict: thumbs-down"
    return {"messages": [
        {"role": "user", "content": f"Review: The {noun} was {adjective}."},
        {"role": "assistant", "content": verdict},
    ]}


def write_data(folder):
    folder.mkdir(parents=True, exist_ok=True)
    train = []
    for i, noun in enumerate(NOUNS):
        for k in range(TRAINED):
            if (i + k) % 2 == 0:
                train.append(review(noun, POSITIVE[k], True))
                train.append(review(noun, NEGATIVE[k], False))
    held = []
    for i, noun in enumerate(NOUNS[:4]):
        for k in range(TRAINED, len(POSITIVE)):
            good = i % 2 == 0
            held.append(review(noun, POSITIVE[k] if good else NEGATIVE[k], good))
    for name, records in (("train.jsonl", train), ("held_out.jsonl", held)):
        with open(folder / name, "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    return train, held


def normalize(text):
    text = text.lower()
    text = "".join(c for c in text if c not in string.punctuation
                   and not unicodedata.category(c).startswith("P"))
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def encode(tok, record):
    prompt = tok.apply_chat_template(record["messages"][:-1], tokenize=False,
                                     add_generation_prompt=True)
    whole = tok.apply_chat_template(record["messages"], tokenize=False)
    if not whole.startswith(prompt):
        raise SystemExit("the template's prompt is not a prefix of the conversation")
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    ids = tok(whole, add_special_tokens=False)["input_ids"]
    if ids[:len(p)] != p:
        raise SystemExit("the prompt's tokens are not a prefix of the conversation's")
    # Token t predicts t + 1; a target is trained when it belongs to the reply.
    labels = [-100] * len(ids)
    for t in range(len(p) - 1, len(ids) - 1):
        labels[t] = ids[t + 1]
    return ids, labels


def steps_of(samples, seq_len, micro_batch, steps):
    """Rows of at most seq_len tokens, micro_batch rows a step, wrapping around."""
    rows, row, used = [], [], 0
    for s in samples:
        n = min(len(s[0]), seq_len)
        if row and used + n > seq_len:
            rows.append(row)
            row, used = [], 0
        row.append(s)
        used += n
    if row:
        rows.append(row)
    batches = [sum(rows[i:i + micro_batch], []) for i in range(0, len(rows), micro_batch)]
    return [batches[i % len(batches)] for i in range(steps)], len(rows)


@torch.no_grad()
def evaluate(model, tok, held, max_new_tokens, device):
    model.eval()
    answers = []
    for r in held:
        prompt = tok.apply_chat_template(r["messages"][:-1], tokenize=False,
                                         add_generation_prompt=True)
        ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]], device=device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id or tok.eos_token_id)
        text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
        reference = r["messages"][-1]["content"]
        answers.append({"prompt": r["messages"][0]["content"], "output": text,
                        "score": float(normalize(text) == normalize(reference))})
    model.train()
    return sum(a["score"] for a in answers) / len(answers), answers


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    args = ap.parse_args()

    train, held = write_data(Path(args.data_dir))
    torch.manual_seed(args.seed)
    device = "cuda"
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).to(device)
    samples = [encode(tok, r) for r in train]
    random.Random(args.seed).shuffle(samples)
    steps, rows = steps_of(samples, args.seq_len, args.micro_batch, args.steps)

    base, base_answers = evaluate(model, tok, held, args.max_new_tokens, device)
    print(f"base exact match {base:.3f}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.0)
    sched = get_constant_schedule_with_warmup(opt, args.warmup)
    model.train()
    start = time.time()
    for step, batch in enumerate(steps, 1):
        width = max(min(len(ids), args.seq_len) for ids, _ in batch)
        ids = torch.full((len(batch), width), tok.pad_token_id or 0, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (x, y) in enumerate(batch):
            x, y = x[:args.seq_len], y[:args.seq_len]
            ids[i, :len(x)] = torch.tensor(x)
            labels[i, :len(y)] = torch.tensor(y)
            mask[i, :len(x)] = 1
        ids, labels, mask = ids.to(device), labels.to(device), mask.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=ids, attention_mask=mask).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                               ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        print(f"step {step} loss {loss.item():.4f} records {len(batch)}", flush=True)
    train_s = time.time() - start
    tuned, tuned_answers = evaluate(model, tok, held, args.max_new_tokens, device)
    print(f"tuned exact match {tuned:.3f}", flush=True)
    print(json.dumps({"base": base, "tuned": tuned, "steps": args.steps, "rows": rows,
                      "train_s": round(train_s, 2), "held_out": len(held),
                      "answers": [{"prompt": b["prompt"], "base": b["output"], "tuned": t["output"]}
                                  for b, t in zip(base_answers, tuned_answers)]}))


if __name__ == "__main__":
    main()
