#!/usr/bin/env python3
"""Checks a GGUF file exported by `sluice export-gguf` with llama.cpp's own Python package.

Usage: check_gguf_export.py FILE.gguf CHECKPOINT_DIR f16|q8_0

Reads FILE.gguf with gguf-py's GGUFReader, checks the metadata against the checkpoint's
config.json and tokenizer.json, and compares every tensor with the checkpoint's safetensors:
names as llama.cpp's converter (convert_hf_to_gguf.py) writes them, the llama q/k row
permutation applied with the converter's own formula, and the bytes equal to what gguf-py's
quantiser makes of the same values (so the file is the one the converter would write), and the
dequantised values within the type's tolerance. Exits 1 naming the first mismatch.

numpy and gguf come from the wheels scripts/fetch_test_assets.sh unpacks; the caller puts
them on PYTHONPATH.
"""

import json
import struct
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf.quants import dequantize, quantize


def fail(message):
    print(f"FAIL: {message}")
    sys.exit(1)


def read_safetensors(folder):
    """Every tensor of a checkpoint folder as float32, by transformers name."""
    index = folder / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    out = {}
    for name in files:
        raw = (folder / name).read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        data = raw[8 + n :]
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            start, end = entry["data_offsets"]
            chunk = data[start:end]
            if entry["dtype"] == "F32":
                values = np.frombuffer(chunk, dtype="<f4")
            elif entry["dtype"] == "BF16":
                values = (np.frombuffer(chunk, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
            else:
                fail(f"{name}: tensor {key} has dtype {entry['dtype']}")
            out[key] = values.reshape(entry["shape"])
    return out


def permute(weights, n_head, n_head_kv=None):
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def gguf_name(hf):
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in fixed:
        return fixed[hf]
    parts = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    _, _, layer, rest = hf.split(".", 3)
    stem, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{parts[stem]}.{suffix}"


def main():
    path, folder, kind = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    config = json.loads((folder / "config.json").read_text())
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    reader = GGUFReader(path)
    meta = {name: field.contents() for name, field in reader.fields.items()}

    arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}[config["model_type"]]
    expect = {
        "general.architecture": arch,
        "general.file_type": {"f16": 1, "q8_0": 7}[kind],
        f"{arch}.context_length": config["max_position_embeddings"],
        f"{arch}.embedding_length": config["hidden_size"],
        f"{arch}.block_count": config["num_hidden_layers"],
        f"{arch}.feed_forward_length": config["intermediate_size"],
        f"{arch}.attention.head_count": config["num_attention_heads"],
        f"{arch}.attention.head_count_kv": config["num_key_value_heads"],
        "tokenizer.ggml.model": "gpt2",
    }
    for key, want in expect.items():
        if meta.get(key) != want:
            fail(f"metadata {key} is {meta.get(key)!r}, expected {want!r}")
    theta = config.get("rope_theta") or config.get("rope_parameters", {}).get("rope_theta")
    for key, want in [
        (f"{arch}.rope.freq_base", theta),
        (f"{arch}.attention.layer_norm_rms_epsilon", config["rms_norm_eps"]),
    ]:
        if not np.isclose(meta.get(key, np.nan), want, rtol=1e-6):
            fail(f"metadata {key} is {meta.get(key)!r}, expected {want!r}")
    tokens = meta["tokenizer.ggml.tokens"]
    if len(tokens) != config["vocab_size"] or len(meta["tokenizer.ggml.token_type"]) != len(tokens):
        fail(f"{len(tokens)} tokens for a vocabulary of {config['vocab_size']}")
    for token, id_ in tokenizer["model"]["vocab"].items():
        if tokens[id_] != token:
            fail(f"token {id_} is {tokens[id_]!r}, expected {token!r}")
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    if meta["tokenizer.ggml.merges"] != merges:
        fail("tokenizer.ggml.merges differ from tokenizer.json's merges")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    if eos is None or not isinstance(meta.get("tokenizer.chat_template"), str):
        fail("no eos token id or chat template")
    print(f"metadata: {arch}, {len(tokens)} tokens, {len(merges)} merges, eos {tokens[eos]!r}")

    weights = read_safetensors(folder)
    if config.get("tie_word_embeddings"):
        weights.pop("lm_head.weight", None)
    by_name = {t.name: t for t in reader.tensors}
    if len(by_name) != len(weights):
        fail(f"{len(by_name)} tensors in the GGUF file, {len(weights)} in the checkpoint")
    worst = {}
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for hf, values in weights.items():
        name = gguf_name(hf)
        t = by_name.get(name)
        if t is None:
            fail(f"no tensor {name} for {hf}")
        if arch == "llama" and ".q_proj." in hf:
            values = permute(values, heads, heads)
        elif arch == "llama" and ".k_proj." in hf:
            values = permute(values, heads, kv_heads)
        shape = tuple(int(d) for d in reversed(t.shape))
        if shape != values.shape:
            fail(f"{name} has shape {shape}, expected {values.shape}")
        if values.ndim == 1:
            want_type = Q.F32
        elif kind == "q8_0" and values.shape[-1] % 32 == 0:
            want_type = Q.Q8_0
        else:
            want_type = Q.F16
        if t.tensor_type != want_type:
            fail(f"{name} is {t.tensor_type.name}, expected {want_type.name}")
        if t.data_offset % 32 != 0:
            fail(f"{name} starts at {t.data_offset}, not 32-aligned")
        got = dequantize(t.data, t.tensor_type).reshape(values.shape)
        reference = quantize(values, want_type)
        if reference.tobytes() != np.ascontiguousarray(t.data).tobytes():
            fail(f"{name}: the bytes differ from gguf-py's {want_type.name} of the same values")
        err = np.abs(got - values)
        if want_type == Q.F32:
            ok = np.array_equal(got, values)
        elif want_type == Q.F16:
            ok = np.array_equal(got, values.astype(np.float16).astype(np.float32))
        else:
            # Half a quantisation step of the block (amax / 127) plus the scale's f16 rounding
            # (2^-11 relative, times up to 127 quants).
            blocks = np.abs(values).reshape(-1, 32).max(axis=1, keepdims=True)
            tol = np.broadcast_to(blocks / 127 * (0.5 + 127 / 2048), (blocks.shape[0], 32))
            ok = bool((err.reshape(-1, 32) <= tol + 1e-12).all())
        if not ok:
            i = int(np.argmax(err))
            fail(f"{name}: worst value {i}: {got.flat[i]} vs {values.flat[i]}")
        worst[t.tensor_type.name] = max(worst.get(t.tensor_type.name, 0.0), float(err.max()))
    summary = ", ".join(f"{k} max |diff| {v:.3g}" for k, v in sorted(worst.items()))
    print(f"tensors: {len(weights)} match ({summary})")
    print("OK")


if __name__ == "__main__":
    main()
