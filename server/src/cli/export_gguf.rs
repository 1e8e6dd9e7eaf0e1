//! `sluice export-gguf`: write a checkpoint folder as one GGUF file for llama.cpp and Ollama.

use std::path::PathBuf;

use anyhow::Context;
use sluice_engine::convert::{GgufType, export_gguf};

#[derive(Debug, clap::Args)]
pub(crate) struct ExportGgufArgs {
    /// The checkpoint folder (llama, mistral or qwen2; config.json, safetensors, tokenizer.json).
    #[arg(value_name = "CHECKPOINT")]
    checkpoint: PathBuf,

    /// How the weight matrices are stored: f16, or q8_0 (8-bit blocks, about half the size).
    #[arg(long = "type", value_name = "TYPE", default_value = "q8_0")]
    ty: GgufType,

    /// The file to write (written under a temporary name and renamed when complete).
    #[arg(short, long, value_name = "FILE")]
    out: PathBuf,
}

pub(crate) fn run(args: ExportGgufArgs) -> anyhow::Result<()> {
    let summary = export_gguf(&args.checkpoint, &args.out, args.ty)
        .with_context(|| format!("exporting {}", args.checkpoint.display()))?;
    println!(
        "exported {} -> {}: {} architecture, {} tensors, matrices in {}, {:.1} MB",
        args.checkpoint.display(),
        args.out.display(),
        summary.architecture,
        summary.tensors,
        args.ty.name().to_uppercase(),
        summary.bytes as f64 / 1e6
    );
    Ok(())
}
