//! `sluice generate`: continue a prompt with a model folder on the CPU or a GPU, streaming
//! tokens to stdout and the speed to stderr; `--dump-logits` also writes the prompt's logits for
//! comparison with transformers.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use sluice_engine::backend::Backend;
use sluice_engine::backend::cpu::Cpu;
use sluice_engine::backend::cuda::Cuda;
use sluice_engine::generate::{GenerateOptions, Generator, PromptStyle, write_logits};

use super::device::Device;

#[derive(Debug, clap::Args)]
pub(crate) struct GenerateArgs {
    /// Hugging Face model folder (config.json, safetensors weights, tokenizer.json).
    #[arg(long, value_name = "DIR")]
    model: PathBuf,

    /// The text to continue.
    #[arg(long)]
    prompt: String,

    /// Wrap the prompt as a user turn in the model's chat template.
    #[arg(long)]
    chat: bool,

    /// Most tokens to generate (generation also stops at the end-of-sequence token).
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,

    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,

    /// Nucleus sampling: keep the most likely tokens up to this probability mass.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,

    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    seed: u64,

    /// Also write the prompt's token ids and logits (safetensors: input_ids, logits).
    #[arg(long, value_name = "FILE")]
    dump_logits: Option<PathBuf>,

    /// Device to run on: cpu, or cuda / cuda:N for an NVIDIA GPU (bf16 weights and activations,
    /// f32 logits).
    #[arg(long, default_value = "cpu")]
    device: Device,
}

pub(crate) fn run(args: GenerateArgs) -> anyhow::Result<()> {
    match args.device {
        Device::Cpu => generate_on(Cpu, &args),
        Device::Cuda(ordinal) => {
            let gpu = Cuda::new(ordinal)
                .with_context(|| format!("--device cuda:{ordinal}: cannot use the GPU"))?;
            generate_on(gpu, &args)
        }
    }
}

fn generate_on<B: Backend>(backend: B, args: &GenerateArgs) -> anyhow::Result<()> {
    let generator = Generator::load_dir_on(backend, &args.model)
        .with_context(|| format!("loading {}", args.model.display()))?;
    let style = if args.chat { PromptStyle::Chat } else { PromptStyle::Plain };
    let prompt = generator.prompt_ids(&args.prompt, style)?;
    if let Some(path) = &args.dump_logits {
        let logits = generator.logits(&mut generator.cache(), &prompt)?;
        write_logits(path, &prompt, &logits, generator.spec().vocab)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    let options = GenerateOptions {
        max_new_tokens: args.max_new_tokens,
        temperature: args.temperature,
        top_p: args.top_p,
        seed: args.seed,
    };
    if options.max_new_tokens == 0 {
        return Ok(());
    }
    // Decode the whole continuation each time and print what is new, so multi-byte characters
    // split across tokens come out whole.
    let mut ids = Vec::new();
    let mut printed = String::new();
    let mut out = std::io::stdout().lock();
    let mut failure = None;
    let start = Instant::now();
    // When the first new token arrives the prompt has run; the rest is decoding.
    let mut first_token = None;
    let generated = generator.generate(&prompt, &options, &mut |id| {
        first_token.get_or_insert_with(Instant::now);
        ids.push(id);
        match generator.decode(&ids) {
            Ok(text) if !text.ends_with('\u{FFFD}') => {
                if let Some(new) = text.get(printed.len()..) {
                    let _ = write!(out, "{new}");
                    let _ = out.flush();
                }
                printed = text;
                true
            }
            Ok(_) => true,
            Err(e) => {
                failure = Some(e);
                false
            }
        }
    })?;
    if let Some(e) = failure {
        return Err(e.into());
    }
    let text = generator.decode(&ids)?;
    if let Some(rest) = text.get(printed.len()..) {
        write!(out, "{rest}")?;
    }
    writeln!(out)?;
    if let Some(first) = first_token {
        // Tokens after the first each cost one decode step (and their detokenisation).
        let decoded = generated.ids.len().saturating_sub(1);
        let decode_s = first.elapsed().as_secs_f64();
        let rate = if decoded > 0 {
            format!(
                ", {decoded} more in {decode_s:.3} s ({:.1} tokens/s)",
                decoded as f64 / decode_s
            )
        } else {
            String::new()
        };
        eprintln!(
            "{} prompt tokens and the first new token in {:.3} s{rate} on {}",
            prompt.len(),
            (first - start).as_secs_f64(),
            generator.backend().name()
        );
    }
    Ok(())
}
