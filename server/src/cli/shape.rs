//! The job-shape flags `train`, `plan` and `bench train` share (flattened into each): the
//! model, the batch shape, the devices and the memory the planner may use. A batch flag left
//! out takes the engine's job default ([`JobSettings::default`]), in all three.

use std::path::PathBuf;

use sluice_engine::plan::BatchShape;
use sluice_engine::train::{Devices, JobSettings, ModelSource};

#[derive(Debug, Clone, clap::Args)]
pub(crate) struct ShapeArgs {
    /// Hugging Face model folder (config.json, safetensors weights, tokenizer.json; `plan`
    /// reads only config.json).
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,

    /// Random-init model shape instead of a folder: tiny, qwen2.5-0.5b, qwen2.5-7b, llama3-8b,
    /// qwen2.5-72b, ...
    #[arg(long, value_name = "NAME")]
    pub preset: Option<String>,

    /// Tokens per packed row [default: 256].
    #[arg(long)]
    pub seq_len: Option<usize>,

    /// Rows per micro-batch [default: 4].
    #[arg(long)]
    pub micro_batch: Option<usize>,

    /// Micro-batches per optimizer step [default: 1].
    #[arg(long)]
    pub grad_accum: Option<usize>,

    /// cpu, cuda / cuda:N for an NVIDIA GPU, or cuda:0,1,... for several GPUs of this host
    /// sharing each step's micro-batches (data parallelism through NCCL; --grad-accum must be
    /// at least the number of GPUs; `bench train` measures one device) [default: train: cpu, or
    /// the run's with --resume; plan: GPU 0, or an H200 assumed when no GPU can be read; bench
    /// train: GPU 0 when one is usable, else cpu].
    #[arg(long)]
    pub device: Option<Devices>,

    /// GPU memory the job may use, in bytes, per GPU [default: the GPU's free memory, from the
    /// driver].
    #[arg(long, value_name = "BYTES")]
    pub gpu_mem: Option<u64>,

    /// Host memory the job may use, in bytes [default: MemAvailable from /proc/meminfo].
    #[arg(long, value_name = "BYTES")]
    pub host_mem: Option<u64>,
}

impl ShapeArgs {
    /// The model the flags name: the folder, else the preset.
    pub fn source(&self) -> anyhow::Result<ModelSource> {
        match (&self.model, &self.preset) {
            (Some(dir), _) => Ok(ModelSource::Dir(dir.clone())),
            (None, Some(name)) => Ok(ModelSource::Preset(name.clone())),
            (None, None) => anyhow::bail!("give --model DIR or --preset NAME"),
        }
    }

    /// The batch shape, with the engine's defaults for what is not given.
    pub fn batch(&self) -> BatchShape {
        let d = JobSettings::default();
        BatchShape {
            seq_len: self.seq_len.unwrap_or(d.seq_len),
            micro_batch: self.micro_batch.unwrap_or(d.micro_batch),
            grad_accum: self.grad_accum.unwrap_or(d.grad_accum),
        }
    }
}
