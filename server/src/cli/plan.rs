//! `sluice plan`: where a training job's bytes would live, what a step would cost, or why the
//! job does not fit and what would.

use std::path::PathBuf;

use anyhow::Context;
use sluice_engine::plan::{
    BatchShape, GpuQuery, MachineMemory, MachineRates, PlanInput, Verdict, plan,
};
use sluice_engine::schedule::from_plan::STREAMER;
use sluice_engine::spec::{ModelSpec, preset};

use super::device::Device;

#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["model", "preset"])))]
pub(crate) struct PlanArgs {
    /// Hugging Face model folder (only config.json is read).
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,

    /// Model shape by name: qwen2.5-7b, llama3-8b, qwen2.5-14b, qwen2.5-72b, ...
    #[arg(long, value_name = "NAME")]
    preset: Option<String>,

    /// Tokens per packed row.
    #[arg(long)]
    seq_len: usize,

    /// Rows per micro-batch.
    #[arg(long)]
    micro_batch: usize,

    /// Micro-batches per optimizer step.
    #[arg(long)]
    grad_accum: usize,

    /// Device the job would run on: cpu (host memory holds everything), cuda or cuda:N
    /// [default: GPU 0, or an H200 assumed when no GPU can be read].
    #[arg(long)]
    device: Option<Device>,

    /// GPU memory in bytes [default: the GPU's free memory, read through the driver].
    #[arg(long, value_name = "BYTES")]
    gpu_mem: Option<u64>,

    /// Host memory in bytes [default: MemAvailable from /proc/meminfo].
    #[arg(long, value_name = "BYTES")]
    host_mem: Option<u64>,

    /// GPUs of this host sharing each step's micro-batches (data parallelism); the GPU memory
    /// is each one's.
    #[arg(long, default_value_t = 1)]
    gpus: usize,

    /// Plan with global-norm gradient clipping off (gradients then need no store).
    #[arg(long)]
    no_clip: bool,

    /// Print the plan as JSON (the web form's format).
    #[arg(long)]
    json: bool,
}

pub(crate) fn run(args: PlanArgs) -> anyhow::Result<()> {
    let spec = match (&args.model, &args.preset) {
        (Some(dir), _) => ModelSpec::from_path(dir)?,
        (None, Some(name)) => preset(name)?,
        (None, None) => anyhow::bail!("give --model DIR or --preset NAME"),
    };
    let gpu = args.device.map_or(GpuQuery::FirstOrH200, Device::gpu_query);
    let memory = MachineMemory::detect(gpu, args.gpu_mem, args.host_mem)
        .context("reading the machine's memory")?;
    let input = PlanInput {
        spec: &spec,
        batch: BatchShape {
            seq_len: args.seq_len,
            micro_batch: args.micro_batch,
            grad_accum: args.grad_accum,
        },
        clipping: !args.no_clip,
        memory,
        rates: MachineRates::default(),
        // What `sluice train` would run, not every placement the planner can model.
        supports: STREAMER,
        gpus: args.gpus,
    };
    let verdict = plan(&input)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&verdict)?);
        return match verdict {
            Verdict::Fits(_) => Ok(()),
            Verdict::Refused(r) => Err(anyhow::anyhow!("does not fit: {r}")),
        };
    }
    match verdict {
        Verdict::Fits(plan) => {
            println!("{plan}");
            Ok(())
        }
        Verdict::Refused(r) => {
            print!("{}", r.details());
            Err(anyhow::anyhow!("does not fit: {r}"))
        }
    }
}
