//! The job-shape flags `train`, `plan` and `bench train` share (flattened into each): the
//! model, the batch shape, the devices, the memory the planner may use and where the Adam
//! moments may live (host memory, the disk tier). A batch flag left out takes the engine's job
//! default ([`JobSettings::default`]), in all three.

use std::path::{Path, PathBuf};

use anyhow::Context;
use sluice_engine::plan::{
    BatchShape, DiskSpace, GpuQuery, MachineMemory, MemorySource, MomentsPolicy,
};
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

    /// The disk tier: a folder on a local SSD (created if missing) where Adam moments that host
    /// memory cannot hold live in a file, read and written at every update; its free space and
    /// read and write rates are measured before planning (a few hundred MiB written and read
    /// back) [default: no disk tier].
    #[arg(long, value_name = "DIR")]
    pub disk_dir: Option<PathBuf>,

    /// Bytes of the disk tier the job may use [default: the folder's free space].
    #[arg(long, value_name = "BYTES", requires = "disk_dir")]
    pub disk_mem: Option<u64>,

    /// Where the Adam moments live: auto (host memory, and the disk tier for as few units as
    /// host memory needs), host (host memory only) or disk (every unit's on the disk tier;
    /// needs --disk-dir) [default: auto].
    #[arg(long, value_name = "POLICY")]
    pub moments: Option<MomentsPolicy>,
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

    /// The machine's memory for a job on `gpu` with the moments policy `moments`: the flags'
    /// figures, the rest read from the machine, and the disk tier where `--disk-dir` names one
    /// (measured now).
    pub fn memory(&self, gpu: GpuQuery, moments: MomentsPolicy) -> anyhow::Result<MachineMemory> {
        let memory = MachineMemory::detect(gpu, self.gpu_mem, self.host_mem)
            .context("reading the machine's memory")?;
        let disk = disk_tier(moments, self.disk_dir.as_deref(), self.disk_mem)?;
        Ok(MachineMemory { disk, ..memory })
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

/// The disk tier at `dir` (created if missing, then measured), its bytes capped at `cap`;
/// `None` without a folder, which `moments: disk` cannot do without.
pub(crate) fn disk_tier(
    moments: MomentsPolicy,
    dir: Option<&Path>,
    cap: Option<u64>,
) -> anyhow::Result<Option<DiskSpace>> {
    let Some(dir) = dir else {
        anyhow::ensure!(
            moments != MomentsPolicy::Disk,
            "--moments disk keeps every unit's Adam moments on the disk tier: give its folder, on \
             a local SSD, with --disk-dir DIR"
        );
        return Ok(None);
    };
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create the disk tier's folder {}", dir.display()))?;
    let space = sluice_engine::store::disk::probe(dir)
        .with_context(|| format!("measuring the disk tier at {}", dir.display()))?;
    Ok(Some(match cap {
        Some(bytes) => {
            DiskSpace { bytes: bytes.min(space.bytes), source: MemorySource::Given, ..space }
        }
        None => space,
    }))
}
