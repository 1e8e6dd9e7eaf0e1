#!/usr/bin/env python3
"""Writes datasets/demo-alpaca.jsonl: about 1,000 short alpaca records that a tiny model can
visibly learn (arithmetic with worked answers, unit conversions, words spelled backwards, and
short facts about how Sluice streams layers). All text is generated here; the output is
deterministic (fixed seed, no dependence on time or environment).

Usage: python3 scripts/make_demo_dataset.py [output_path]
"""

import json
import random
import sys
from pathlib import Path

SEED = 20260405
N_ARITH = 330
N_UNITS = 230
N_BACKWARDS = 230
N_SLUICE = 210


def arithmetic(rng):
    op = rng.choice(["+", "-", "*"])
    if op == "*":
        a, b = rng.randint(2, 19), rng.randint(2, 12)
    else:
        a, b = rng.randint(10, 499), rng.randint(2, 299)
    if op == "-" and b > a:
        a, b = b, a
    name = {"+": "plus", "-": "minus", "*": "times"}[op]
    result = {"+": a + b, "-": a - b, "*": a * b}[op]
    instruction = rng.choice(
        [
            f"What is {a} {op} {b}?",
            f"Compute {a} {name} {b}.",
            f"Calculate {a} {op} {b} and show your work.",
            f"How much is {a} {name} {b}?",
        ]
    )
    if op == "+":
        tens = (b // 10) * 10
        ones = b - tens
        work = f"{a} + {tens} = {a + tens}, then {a + tens} + {ones} = {result}."
    elif op == "-":
        tens = (b // 10) * 10
        ones = b - tens
        work = f"{a} - {tens} = {a - tens}, then {a - tens} - {ones} = {result}."
    else:
        work = f"{a} * {b} is {b} groups of {a}: {' + '.join([str(a)] * min(b, 4))}{' + ...' if b > 4 else ''} = {result}."
    return {"instruction": instruction, "input": "", "output": f"{work} The answer is {result}."}


UNITS = [
    # (from, to, factor, digits)
    ("kilometres", "metres", 1000, 0),
    ("metres", "centimetres", 100, 0),
    ("kilograms", "grams", 1000, 0),
    ("hours", "minutes", 60, 0),
    ("minutes", "seconds", 60, 0),
    ("litres", "millilitres", 1000, 0),
    ("miles", "kilometres", 1.609, 2),
    ("inches", "centimetres", 2.54, 2),
    ("pounds", "kilograms", 0.4536, 2),
    ("gigabytes", "megabytes", 1024, 0),
]


def units(rng):
    src, dst, factor, digits = rng.choice(UNITS)
    value = rng.randint(1, 60)
    result = value * factor
    shown = f"{result:.{digits}f}" if digits else str(int(result))
    instruction = rng.choice(
        [
            f"Convert {value} {src} to {dst}.",
            f"How many {dst} are in {value} {src}?",
            "Convert this quantity.",
        ]
    )
    inp = f"{value} {src} to {dst}" if instruction == "Convert this quantity." else ""
    output = f"One of the {src} is {factor} {dst}, so {value} {src} is {value} * {factor} = {shown} {dst}."
    return {"instruction": instruction, "input": inp, "output": output}


WORDS = (
    "river stream layer weight model token queue sluice gate water memory engine batch stone "
    "garden window planet silver orange yellow simple little market bridge castle forest pencil "
    "rocket butter winter summer spring autumn mirror letter number kernel vector matrix tensor "
    "signal packet socket thread bottle candle copper harbor island jungle ladder meadow needle "
    "paddle rabbit saddle tunnel velvet wagon zebra anchor basket cactus donkey feather guitar"
).split()


def backwards(rng):
    word = rng.choice(WORDS)
    spelled = "-".join(word)
    rev = word[::-1]
    style = rng.randrange(3)
    if style == 0:
        return {
            "instruction": f"Spell the word '{word}' backwards.",
            "input": "",
            "output": f"The letters are {spelled}. Reversed: {'-'.join(rev)}. The word backwards is '{rev}'.",
        }
    if style == 1:
        return {
            "instruction": "Write the given word in reverse order.",
            "input": word,
            "output": f"{word} reversed is {rev}.",
        }
    return {
        "instruction": f"What is '{word}' read from right to left?",
        "input": "",
        "output": f"Reading '{word}' from the last letter to the first gives '{rev}'.",
    }


SLUICE_FACTS = [
    (
        ["Where does Sluice keep the master weights?", "Where do the fp32 weights live during training?"],
        [
            "In host memory. Sluice keeps fp32 master weights, gradients and Adam moments in RAM.",
            "The fp32 master weights stay in host RAM, together with the gradients and Adam state.",
        ],
    ),
    (
        ["How does a layer reach the GPU in Sluice?", "How are layers moved to the GPU?"],
        [
            "Each layer is streamed over PCIe just before it computes, then its slot is reused by the next layer.",
            "Layers flow through the GPU one at a time: copied in over PCIe, computed, then replaced.",
        ],
    ),
    (
        ["How often does Sluice stream the weights?", "How many times per step are weights uploaded?"],
        [
            "Once per optimizer step for the forward pass and once for the backward pass, whatever the batch size.",
            "Twice per step: once going forward and once going backward, independent of the number of micro-batches.",
        ],
    ),
    (
        ["Where does Sluice run the optimizer?", "Which device runs AdamW in Sluice?"],
        [
            "AdamW runs on the CPU, where the optimizer state lives, while the GPU keeps computing.",
            "The CPU runs AdamW next to its state in host memory, overlapped with GPU work.",
        ],
    ),
    (
        ["Why does Sluice use the GPU as a cache?", "What is the GPU's role in Sluice?"],
        [
            "Host RAM is cheaper per byte, so it holds the model and the GPU only caches the layers being computed.",
            "The GPU is a cache: it holds the layer that is computing and the one arriving next.",
        ],
    ),
    (
        ["What precision are Sluice's master weights?", "Does Sluice keep bf16 master weights?"],
        [
            "Sluice keeps fp32 master weights; bf16 is used only for matrix multiplies and activations.",
            "No. Master weights and Adam moments are fp32; only the streamed copy is bf16.",
        ],
    ),
    (
        ["What are activation checkpoints in Sluice?", "How does Sluice save memory on activations?"],
        [
            "Sluice keeps one input per layer and recomputes the layer's internals during the backward pass.",
            "It checkpoints each layer's input and recomputes the rest block by block in the backward pass.",
        ],
    ),
    (
        ["How does Sluice overlap copies and compute?", "Do transfers wait for compute in Sluice?"],
        [
            "Copies run on their own stream with double buffers, so the next layer arrives while this one computes.",
            "No. The next layer is prefetched on a separate stream while the current layer computes.",
        ],
    ),
]


def sluice(rng):
    questions, answers = rng.choice(SLUICE_FACTS)
    question = rng.choice(questions)
    if rng.random() < 0.2:
        return {"instruction": "Answer briefly.", "input": question, "output": rng.choice(answers)}
    return {"instruction": question, "input": "", "output": rng.choice(answers)}


def main():
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "datasets" / "demo-alpaca.jsonl"
    rng = random.Random(SEED)
    records = (
        [arithmetic(rng) for _ in range(N_ARITH)]
        + [units(rng) for _ in range(N_UNITS)]
        + [backwards(rng) for _ in range(N_BACKWARDS)]
        + [sluice(rng) for _ in range(N_SLUICE)]
    )
    rng.shuffle(records)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8", newline="\n") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    print(f"wrote {len(records)} records to {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
