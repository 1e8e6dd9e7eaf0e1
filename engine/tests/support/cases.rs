//! The golden fixtures' model cases (`tests/golden/<case>/`): one per family and variant, the
//! mixtures of experts included. The golden, streaming and GPU tests all run every one.

pub const GOLDEN_CASES: [&str; 12] = [
    "llama",
    "llama-linear",
    "qwen2",
    "qwen3",
    "mistral",
    "phi3",
    "gemma3",
    "gemma2",
    "mixtral",
    "qwen3_moe",
    "gpt_oss",
    "qwen2_moe",
];
