//! `sluice import-gguf`: turn a llama.cpp GGUF file into a Hugging Face folder of f32 weights
//! with its config, tokenizer and chat template.

use std::path::PathBuf;

use anyhow::Context;
use sluice_engine::convert::import_gguf;

#[derive(Debug, clap::Args)]
pub(crate) struct ImportGgufArgs {
    /// The GGUF file (llama architecture; F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K or Q6_K).
    #[arg(value_name = "FILE")]
    file: PathBuf,

    /// Folder to write (replaced atomically if it exists).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
}

pub(crate) fn run(args: ImportGgufArgs) -> anyhow::Result<()> {
    let summary = import_gguf(&args.file, &args.out)
        .with_context(|| format!("importing {}", args.file.display()))?;
    let spec = &summary.spec;
    let types: Vec<String> =
        summary.tensor_types.iter().map(|(name, n)| format!("{n} {name}")).collect();
    println!(
        "imported {} -> {}: {} layers, hidden {}, {} heads ({} kv), vocab {}, {:.1}M parameters \
         (tensors: {})",
        args.file.display(),
        args.out.display(),
        spec.layers,
        spec.hidden,
        spec.q_heads,
        spec.kv_heads,
        summary.vocab_size,
        spec.total_params() as f64 / 1e6,
        types.join(", ")
    );
    Ok(())
}
