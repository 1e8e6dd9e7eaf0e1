#!/usr/bin/env python3
"""Trains the tiny byte-level BPE tokenizer shipped in engine/assets/tiny-tokenizer/ on the demo
dataset (datasets/demo-alpaca.jsonl), for demos and tests with random-init models.

Vocabulary: 2,048 entries, the first three being the special tokens <|endoftext|> (0),
<|im_start|> (1) and <|im_end|> (2). Byte-level, so any text encodes. The chat template is
ChatML in the style of Qwen2.5, with no default system message; eos is <|im_end|>.

Requires `pip install tokenizers`. Deterministic for a given tokenizers version.
Usage: python3 scripts/make_tiny_tokenizer.py
"""

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parent.parent
DATASET = ROOT / "datasets" / "demo-alpaca.jsonl"
OUT = ROOT / "engine" / "assets" / "tiny-tokenizer"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 2048

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def corpus():
    with open(DATASET, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            text = "\n".join(v for v in (record["instruction"], record["input"], record["output"]) if v)
            # The chat scaffolding appears in every training sample, so it earns its own merges.
            yield f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    # The demo text alone runs out of merges before 2,048 entries; whole numbers are what the
    # arithmetic records need most, so they fill the rest.
    yield " ".join(str(n) for n in range(2000))


def main():
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    for i, token in enumerate(SPECIALS):
        assert tokenizer.token_to_id(token) == i, token

    OUT.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(OUT / "tokenizer.json"), pretty=False)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(OUT / "tokenizer_config.json", "w", encoding="utf-8", newline="\n") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
    print(f"vocab {tokenizer.get_vocab_size()}, wrote {OUT}")


if __name__ == "__main__":
    main()
