#!/usr/bin/env python3
"""Golden fixtures for Sluice's CPU reference, made by PyTorch and Hugging Face transformers.

Pinned versions (those of the GPU test machine); the script refuses to run with others:
    torch == 2.11.0, transformers == 5.17.0  (plus safetensors and numpy, any recent version)

Writes, under tests/golden/ (see tests/golden/README.md for the format):
    <case>/config.json, <case>/model.safetensors   as save_pretrained writes them (f32)
    <case>/fixture.safetensors                     batch, logits, loss, gradients, 5-step trajectory
                                                   (MoE cases also: router logits, experts, aux loss)
    adamw/fixture.safetensors                      torch.optim.AdamW on loose tensors, 3 steps

Everything runs on the CPU in float32 with eager attention (and eager MoE experts), one thread and
fixed seeds, so a rerun on the same machine reproduces the files bit for bit; another CPU agrees
within the tolerances in tests/golden/README.md, not bit for bit.

Usage (from the repository root):
    python -m venv .cache/venv
    .cache/venv/bin/pip install torch==2.11.0 transformers==5.17.0 safetensors numpy
    .cache/venv/bin/python scripts/golden/make_fixtures.py [--out tests/golden] [--cases NAME[,NAME...]]

--cases regenerates only the named cases (model cases and/or `adamw`); the default is all of them.
Each case keeps its own seed whatever the selection, so regenerating one case leaves the others'
files alone and reproduces the named one.
"""

import argparse
import json
import math
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
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
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

# Shared by the Gemma cases: GELU (tanh) MLP, no padding row (pad_token_id None, as in every case:
# an nn.Embedding padding_idx would zero that row's gradient), tied embeddings as Gemma has.
GEMMA = dict(
    hidden_act="gelu_pytorch_tanh",
    hidden_activation="gelu_pytorch_tanh",
    pad_token_id=None,
    tie_word_embeddings=True,
)

# Shared by the MoE cases: 4 experts, top 2, the aux loss in the returned loss.
MOE = dict(
    num_experts_per_tok=2,
    router_aux_loss_coef=0.02,
    output_router_logits=True,
    pad_token_id=None,
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
    # Cases below were added later; each keeps its index in this dict as its seed offset, so the
    # order of the entries above must not change (new cases go at the end).
    "gemma2": (
        Gemma2Config,
        Gemma2ForCausalLM,
        dict(
            **GEMMA,
            query_pre_attn_scalar=4,  # scores scaled by 1/sqrt(4), not 1/sqrt(head_dim 8)
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention"],
            attn_logit_softcapping=3.0,  # pre-cap scores reach about 1x the cap (checked)
            final_logit_softcapping=3.0,  # pre-cap logits reach about 1x the cap (checked)
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        dict(
            **GEMMA,
            num_hidden_layers=3,
            query_pre_attn_scalar=4,
            sliding_window=5,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                "full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1000000.0),
            },
        ),
    ),
    "phi3": (
        Phi3Config,
        Phi3ForCausalLM,
        dict(
            pad_token_id=None,
            tie_word_embeddings=False,
            original_max_position_embeddings=8,  # SEQ 13 > 8: the forward uses long_factor
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=10000.0,
                partial_rotary_factor=0.75,  # 6 of head_dim 8 rotate: 3 frequencies
                short_factor=[1.0, 1.25, 1.5],
                long_factor=[1.0, 3.0, 9.0],
            ),
        ),
    ),
    "mixtral": (
        MixtralConfig,
        MixtralForCausalLM,
        dict(
            **MOE,
            intermediate_size=32,  # the experts' size
            num_local_experts=4,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    "qwen3_moe": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(
            **MOE,
            moe_intermediate_size=32,  # experts; the dense layer 0 uses intermediate_size 80
            num_experts=4,
            norm_topk_prob=True,
            mlp_only_layers=[0],
            decoder_sparse_step=1,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    "qwen2_moe": (
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        dict(
            **MOE,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=56,
            num_experts=4,
            norm_topk_prob=False,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    "gpt_oss": (
        GptOssConfig,
        GptOssForCausalLM,
        dict(
            **MOE,
            intermediate_size=32,  # the experts' size
            head_dim=16,  # 6 x 16 = 96 != 48; 8 rope frequencies for YaRN's ramp
            num_local_experts=4,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention"],
            max_position_embeddings=1024,  # = factor x original_max_position_embeddings
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=4.0,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
                original_max_position_embeddings=256,  # puts the ramp's ends at dims 0.16 and 2.49
            ),
        ),
    ),
}

# Per-case options beyond the config (absent: the defaults every case above "gemma2" uses).
#   norm_center: norm weights are drawn as norm_center + NORM_STD N(0,1); Gemma's RMSNorm scales by
#                (1 + weight), so its weights are drawn around 0 (an effective scale 1 + 0.1 N).
#   std:         parameter-name suffix -> std replacing INIT_STD for those tensors.
#   short_seq:   also store the logits of input_ids[:, :short_seq] (Phi3: the short_factor path).
CASE_OPTIONS = {
    "gemma2": dict(norm_center=0.0),
    "gemma3": dict(norm_center=0.0),
    "phi3": dict(short_seq=8),
    # gate/up pre-activations with std ~3.5, so that a few percent pass the SwiGLU clamp at 7.
    "gpt_oss": dict(std={"mlp.experts.gate_up_proj": 0.5}),
}


def check_versions(allow_other: bool) -> None:
    have = (torch.__version__.split("+")[0], transformers.__version__)
    want = (TORCH_VERSION, TRANSFORMERS_VERSION)
    if have != want:
        msg = f"need torch {want[0]} and transformers {want[1]}, found torch {have[0]} and transformers {have[1]}"
        if not allow_other:
            sys.exit(f"make_fixtures.py: {msg} (pass --allow-other-versions to go on anyway)")
        print(f"warning: {msg}", file=sys.stderr)


def reinit(
    model: torch.nn.Module,
    gen: torch.Generator,
    norm_center: float = 1.0,
    std: dict[str, float] | None = None,
) -> None:
    """Every parameter drawn here, in name order, so the weights do not depend on transformers'
    own init code: norm weights 1 + N(0, 0.1), biases N(0, 0.1), everything else N(0, 0.1).
    A case may center its norm weights elsewhere (Gemma: 0) or give some tensors another std;
    either way every tensor takes the same draws from the generator, in the same order."""
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                p.copy_(norm_center + NORM_STD * noise)
            elif name.endswith(".bias"):
                p.copy_(BIAS_STD * noise)
            else:
                scale = next((v for k, v in (std or {}).items() if name.endswith(k)), INIT_STD)
                p.copy_(scale * noise)


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


def metadata(case: str, config, model_cls, tied: bool) -> dict[str, str]:
    return {
        "case": case,
        "architecture": model_cls.__name__,
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


# ---- Checks that the fixture exercises what its case is for, and that the semantics written in
# ---- tests/golden/README.md are what transformers computes (each fails the script if not).


def layer_of(name: str) -> int:
    return int(name.split(".layers.")[1].split(".")[0])


def routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """The MoE routers by layer index (dense layers have none)."""
    return [(layer_of(n), m) for n, m in model.named_modules() if type(m).__name__.endswith("TopKRouter")]


def close(a: torch.Tensor, b: torch.Tensor, what: str, rtol: float = 1e-6, atol: float = 1e-7) -> None:
    if a.shape != b.shape or not torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol):
        diff = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else "shape"
        raise SystemExit(f"check failed: {what} (max abs diff {diff})")


def check_routing(case: str, config, records: dict, aux: torch.Tensor) -> None:
    """README's routing and aux-loss formulas, recomputed from the router logits."""
    k = config.num_experts_per_tok
    n_exp = config.num_local_experts if hasattr(config, "num_local_experts") else config.num_experts
    counts = torch.zeros(n_exp, dtype=torch.float64)
    prob_sum = torch.zeros(n_exp, dtype=torch.float64)
    rows = 0
    for layer, (logits, weights, experts) in sorted(records.items()):
        logits = logits.detach().float()
        probs = torch.softmax(logits, dim=-1)
        if isinstance(config, GptOssConfig):  # top-k of the logits, softmax over the k chosen
            top = torch.topk(logits, k, dim=-1)
            want_w = torch.softmax(top.values, dim=-1)
        else:  # softmax over all experts, top-k, renormalised (Mixtral always; Qwen if norm_topk_prob)
            top = torch.topk(probs, k, dim=-1)
            want_w = top.values
            if isinstance(config, MixtralConfig) or config.norm_topk_prob:
                want_w = want_w / want_w.sum(dim=-1, keepdim=True)
        if not torch.equal(top.indices, experts):
            raise SystemExit(f"{case}: layer {layer} experts are not the top-{k} the README describes")
        close(weights.detach().float(), want_w, f"{case}: layer {layer} routing weights")
        hit = torch.bincount(experts.reshape(-1), minlength=n_exp)
        if (hit == 0).any():
            raise SystemExit(f"{case}: layer {layer}: an expert receives no token ({hit.tolist()})")
        counts += hit.double()
        prob_sum += probs.double().sum(dim=0)
        rows += logits.shape[0]
    want_aux = n_exp * torch.sum((counts / rows) * (prob_sum / rows))
    close(aux.detach(), want_aux.float(), f"{case}: aux loss formula", rtol=1e-5)


def yarn_inv_freq(rp: dict, dim: int) -> tuple[torch.Tensor, float]:
    """README's YaRN, in f64."""
    base, factor = rp["rope_theta"], rp["factor"]
    beta_fast, beta_slow, orig = rp["beta_fast"], rp["beta_slow"], rp["original_max_position_embeddings"]

    def corr(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr(beta_fast), corr(beta_slow)
    if rp.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    i = torch.arange(dim // 2, dtype=torch.float64)
    ramp = ((i - low) / (high - low)).clamp(0, 1)
    extrap = 1 - ramp  # 1: keep the frequency, 0: divide it by factor
    freq = base ** (-2 * i / dim)
    inv = freq / factor * (1 - extrap) + freq * extrap
    return inv, 0.1 * math.log(factor) + 1.0


def check_rope(case: str, config, model, phase: str) -> None:
    rot = model.model.rotary_emb
    rp = config.rope_parameters
    if isinstance(config, Phi3Config):
        dim = int(config.head_dim * rp["partial_rotary_factor"])
        ext = rp["long_factor"] if phase == "long" else rp["short_factor"]
        i = torch.arange(0, dim, 2, dtype=torch.float64)
        want = 1.0 / (torch.tensor(ext, dtype=torch.float64) * rp["rope_theta"] ** (i / dim))
        close(rot.inv_freq, want.float(), f"{case}: longrope inv_freq ({phase})")
        scale = config.max_position_embeddings / rp["original_max_position_embeddings"]
        want_att = math.sqrt(1 + math.log(scale) / math.log(rp["original_max_position_embeddings"]))
        close(torch.tensor(rot.attention_scaling), torch.tensor(want_att), f"{case}: longrope attention factor")
    elif isinstance(config, GptOssConfig):
        want, want_att = yarn_inv_freq(rp, config.head_dim)
        close(rot.inv_freq, want.float(), f"{case}: yarn inv_freq", rtol=1e-5)
        close(torch.tensor(rot.attention_scaling), torch.tensor(want_att), f"{case}: yarn attention factor")
    elif isinstance(config, Gemma3TextConfig):
        i = torch.arange(0, config.head_dim, 2, dtype=torch.float64)
        for kind in ("sliding_attention", "full_attention"):
            p = rp[kind]
            want = p["rope_theta"] ** (-i / config.head_dim) / p.get("factor", 1.0)
            close(getattr(rot, f"{kind}_inv_freq"), want.float(), f"{case}: {kind} inv_freq", rtol=1e-5)


class Softcaps:
    """Records, in one forward, the largest pre-cap attention score (over unmasked pairs) of each
    layer and the largest pre-cap logit, to check that Gemma 2's caps are reached."""

    def __init__(self, model) -> None:
        import transformers.models.gemma2.modeling_gemma2 as g2

        self.g2, self.model, self.scores, self.logits = g2, model, [], []

    def __enter__(self):
        g2, original = self.g2, self.g2.eager_attention_forward
        self.original = original

        def recording(module, query, key, value, attention_mask, *args, **kwargs):
            keys = g2.repeat_kv(key, module.num_key_value_groups)
            s = torch.matmul(query, keys.transpose(2, 3)) * kwargs["scaling"]
            seen = (attention_mask == 0).expand_as(s)
            self.scores.append(s[seen].abs().max().item())
            return original(module, query, key, value, attention_mask, *args, **kwargs)

        g2.eager_attention_forward = recording
        self.hook = self.model.lm_head.register_forward_hook(
            lambda m, i, o: self.logits.append(o.abs().max().item())
        )
        return self

    def __exit__(self, *exc) -> None:
        self.g2.eager_attention_forward = self.original
        self.hook.remove()


def check_softcaps(case: str, config, model, ids) -> str:
    with torch.no_grad(), Softcaps(model) as rec:
        model(input_ids=ids)
    att = [s / config.attn_logit_softcapping for s in rec.scores]
    fin = rec.logits[0] / config.final_logit_softcapping
    if min(att) < 0.5 or fin < 0.5:
        raise SystemExit(f"{case}: softcaps barely reached (scores/cap {att}, logits/cap {fin})")
    return f"max pre-cap |score|/cap per layer {[round(a, 2) for a in att]}, |logit|/cap {fin:.2f}"


def check_clamp(case: str, model, ids) -> str:
    """GPT-OSS: count the gate and up pre-activations beyond the SwiGLU clamp."""
    seen = {"gate": 0, "up": 0, "n": 0}
    experts = [m for m in model.modules() if type(m).__name__ == "GptOssExperts"]
    for m in experts:
        original = m._apply_gate

        def recording(gate_up, m=m, original=original):
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
            seen["gate"] += int((gate > m.limit).sum())
            seen["up"] += int((up.abs() > m.limit).sum())
            seen["n"] += gate.numel()
            return original(gate_up)

        m._apply_gate = recording
    with torch.no_grad():
        model(input_ids=ids)
    for m in experts:
        del m._apply_gate
    if seen["gate"] == 0 or seen["up"] == 0:
        raise SystemExit(f"{case}: the SwiGLU clamp is not exercised ({seen})")
    return (
        f"gate > 7 in {seen['gate'] / seen['n']:.1%}, |up| > 7 in {seen['up'] / seen['n']:.1%} "
        f"of {seen['n']} expert activations"
    )


def expert_file_names(case: str, config, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What save_pretrained writes for each MoE parameter: transformers 5 keeps the experts fused
    in memory ([E, 2I, H] gate_up_proj) and by default saves the hub's per-expert layout."""
    want: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if ".experts.gate_up_proj" in name and not isinstance(config, GptOssConfig):
            prefix = name.removesuffix("gate_up_proj")
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                if isinstance(config, MixtralConfig):
                    p = prefix.replace(".mlp.", ".block_sparse_moe.")
                    want[f"{p}{e}.w1.weight"], want[f"{p}{e}.w3.weight"] = t[e, :inter], t[e, inter:]
                else:
                    want[f"{prefix}{e}.gate_proj.weight"], want[f"{prefix}{e}.up_proj.weight"] = (
                        t[e, :inter],
                        t[e, inter:],
                    )
        elif ".experts.down_proj" in name and not isinstance(config, GptOssConfig):
            prefix = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                if isinstance(config, MixtralConfig):
                    want[f"{prefix.replace('.mlp.', '.block_sparse_moe.')}{e}.w2.weight"] = t[e]
                else:
                    want[f"{prefix}{e}.down_proj.weight"] = t[e]
        elif isinstance(config, MixtralConfig) and ".mlp.gate." in name:
            want[name.replace(".mlp.", ".block_sparse_moe.")] = t
        else:
            want[name] = t
    return want


def make_case(out: Path, case: str, seed: int) -> None:
    config_cls, model_cls, extra = CASES[case]
    opts = CASE_OPTIONS.get(case, {})
    config = config_cls(**{**COMMON, **extra})
    config._attn_implementation = "eager"
    moe = bool(getattr(config, "output_router_logits", False))
    if moe:
        config._experts_implementation = "eager"  # the plain per-expert loop, not grouped_mm
    gen = torch.Generator().manual_seed(seed)
    model = model_cls(config).float().eval()  # eval: no dropout (all dropout is 0 anyway)
    if model.config._attn_implementation != "eager" or (moe and model.config._experts_implementation != "eager"):
        raise SystemExit(f"{case}: eager attention/experts not in effect")
    reinit(model, gen, opts.get("norm_center", 1.0), opts.get("std"))
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
    if moe:
        params = {n: p.detach() for n, p in model.named_parameters()}
        want = expert_file_names(case, config, params)
        if set(want) != set(saved) or any(not torch.equal(want[k], saved[k]) for k in want):
            raise SystemExit(f"{case}: model.safetensors is not the layout the README describes")
        reloaded = model_cls.from_pretrained(folder, dtype=torch.float32)
        for name, p in reloaded.named_parameters():
            if not torch.equal(p, params[name]):
                raise SystemExit(f"{case}: from_pretrained does not give back {name}")
    missing = [n for n in names if n not in saved]
    if missing and not moe:
        raise SystemExit(f"{case}: parameters not in model.safetensors: {missing}")
    for name, t in saved.items():
        if t.dtype != torch.float32:
            raise SystemExit(f"{case}: {name} saved as {t.dtype}, expected float32")

    tensors: dict[str, torch.Tensor] = {
        "input_ids": ids.to(torch.int32),
        "labels": labels.to(torch.int32),
    }
    notes = []

    # Logits, loss and gradients at the initial weights (MoE: with each router's outputs).
    records: dict[int, tuple] = {}
    hooks = [m.register_forward_hook(lambda m, i, o, layer=layer: records.__setitem__(layer, o)) for layer, m in routers(model)]
    model.zero_grad(set_to_none=True)
    outputs = model(input_ids=ids, labels=labels)
    outputs.loss.backward()
    for h in hooks:
        h.remove()
    tensors["logits"] = outputs.logits.detach().float().contiguous()
    tensors["loss"] = outputs.loss.detach().float().reshape(())
    if moe:
        with torch.no_grad():
            ce = model.loss_function(outputs.logits, labels, config.vocab_size)
        aux = outputs.aux_loss.detach().float().reshape(())
        close(tensors["loss"], ce + config.router_aux_loss_coef * aux, f"{case}: loss = ce + coef * aux")
        check_routing(case, config, records, aux)
        tensors["loss.ce"] = ce.detach().float().reshape(())
        tensors["aux_loss"] = aux
        for layer, (r_logits, r_weights, r_experts) in sorted(records.items()):
            tensors[f"router.{layer}.logits"] = r_logits.detach().float().contiguous()
            tensors[f"router.{layer}.experts"] = r_experts.to(torch.int32).contiguous()
            tensors[f"router.{layer}.weights"] = r_weights.detach().float().contiguous()
        loads = {layer: torch.bincount(r[2].reshape(-1), minlength=r[0].shape[-1]).tolist() for layer, r in records.items()}
        notes.append(f"aux {aux.item():.6f}, tokens per expert by layer {loads}")
    for name, p in model.named_parameters():
        tensors[f"grad.{name}"] = p.grad.detach().clone().contiguous()
    check_rope(case, config, model, "long")
    if "short_seq" in opts:
        short = ids[:, : opts["short_seq"]]
        with torch.no_grad():
            tensors["short.input_ids"] = short.to(torch.int32)
            tensors["short.logits"] = model(input_ids=short).logits.float().contiguous()
        check_rope(case, config, model, "short")
    if isinstance(config, Gemma2Config):
        notes.append(check_softcaps(case, config, model, ids))
    if isinstance(config, GptOssConfig):
        notes.append(check_clamp(case, model, ids))

    # The 5-step trajectory from the same initial weights.
    model.load_state_dict(initial)
    opt = torch.optim.AdamW(
        param_groups(model), lr=LR, betas=BETAS, eps=EPS, foreach=False, fused=False
    )
    sched = get_cosine_schedule_with_warmup(opt, WARMUP_STEPS, TOTAL_STEPS)
    losses, norms, lrs, auxes = [], [], [], []
    for _ in range(TOTAL_STEPS):
        opt.zero_grad(set_to_none=True)
        step_out = model(input_ids=ids, labels=labels)
        loss = step_out.loss
        loss.backward()
        losses.append(loss.item())
        if moe:
            auxes.append(step_out.aux_loss.item())
        lrs.append(opt.param_groups[0]["lr"])
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM).item())
        opt.step()
        sched.step()
    if not norms[0] > MAX_GRAD_NORM:
        raise SystemExit(f"{case}: clipping is not active on step 1 (norm {norms[0]})")
    tensors["traj.loss"] = torch.tensor(losses, dtype=torch.float32)
    tensors["traj.grad_norm"] = torch.tensor(norms, dtype=torch.float32)
    tensors["traj.lr"] = torch.tensor(lrs, dtype=torch.float32)
    if moe:
        tensors["traj.aux_loss"] = torch.tensor(auxes, dtype=torch.float32)
    for name, p in model.named_parameters():
        tensors[f"final.{name}"] = p.detach().clone().contiguous()

    meta = metadata(case, config, model_cls, tied)
    meta["traj.lr_f64"] = json.dumps(lrs)
    if "norm_center" in opts:
        meta["init.norm"] = f"{opts['norm_center']} + {NORM_STD} N(0,1) (the norm scales by 1 + weight)"
    for suffix, value in opts.get("std", {}).items():
        meta[f"init.std.{suffix}"] = repr(value)
    if "short_seq" in opts:
        meta["short.seq_len"] = str(opts["short_seq"])
    if moe:
        meta["loss"] += "; plus router_aux_loss_coef * aux_loss"
        meta["moe.num_experts"] = str(records[min(records)][0].shape[-1])
        meta["moe.top_k"] = str(config.num_experts_per_tok)
        meta["moe.router_aux_loss_coef"] = repr(config.router_aux_loss_coef)
        meta["moe.layers"] = json.dumps(sorted(records))
        meta["moe.experts_implementation"] = "eager"
    save_fixture(tensors, folder / "fixture.safetensors", meta)
    clipped = sum(n > MAX_GRAD_NORM for n in norms)
    print(
        f"{case}: loss {tensors['loss'].item():.6f}, trajectory {[round(x, 5) for x in losses]}, "
        f"grad norms {[round(x, 3) for x in norms]} (clipping active on {clipped} of {TOTAL_STEPS} "
        f"steps, including step 1), {len(names)} parameters"
    )
    for note in notes:
        print(f"{case}: {note}")


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
    parser.add_argument(
        "--cases",
        default=",".join([*CASES, "adamw"]),
        help="comma-separated cases to (re)generate, of: " + ", ".join([*CASES, "adamw"]) + " (default: all)",
    )
    args = parser.parse_args()
    chosen = [c for c in args.cases.split(",") if c]
    unknown = [c for c in chosen if c not in CASES and c != "adamw"]
    if unknown or not chosen:
        parser.error(f"unknown case(s) {unknown}; known: {', '.join([*CASES, 'adamw'])}")
    check_versions(args.allow_other_versions)
    torch.set_num_threads(1)  # reductions in one fixed order
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    for i, case in enumerate(CASES):  # the seed is the case's index in CASES, whatever is chosen
        if case in chosen:
            make_case(args.out, case, SEED + i)
    if "adamw" in chosen:
        make_adamw(args.out, SEED + 100)


if __name__ == "__main__":
    main()
