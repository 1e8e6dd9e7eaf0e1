//! `sluice plan`: where a training job's bytes would live, what a step would cost, or why the
//! job does not fit and what would.

use anyhow::Context;
use sluice_engine::plan::{GpuQuery, MachineMemory, MachineRates, PlanInput, Verdict, plan};
use sluice_engine::schedule::from_plan::STREAMER;
use sluice_engine::spec::{ModelSpec, preset};
use sluice_engine::train::ModelSource;

use super::shape::ShapeArgs;

#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["model", "preset"])))]
pub(crate) struct PlanArgs {
    #[command(flatten)]
    shape: ShapeArgs,

    /// Plan with global-norm gradient clipping off (gradients then need no store).
    #[arg(long)]
    no_clip: bool,

    /// Print the plan as JSON (the web form's format).
    #[arg(long)]
    json: bool,
}

pub(crate) fn run(args: PlanArgs) -> anyhow::Result<()> {
    let spec = match args.shape.source()? {
        ModelSource::Dir(dir) => ModelSpec::from_path(&dir)?,
        ModelSource::Preset(name) => preset(&name)?,
    };
    let (gpu, gpus) = match &args.shape.device {
        None => (GpuQuery::FirstOrH200, 1),
        Some(devices) => (devices.gpu_query(), devices.gpus().len().max(1)),
    };
    let memory = MachineMemory::detect(gpu, args.shape.gpu_mem, args.shape.host_mem)
        .context("reading the machine's memory")?;
    let input = PlanInput {
        spec: &spec,
        batch: args.shape.batch(),
        clipping: !args.no_clip,
        memory,
        rates: MachineRates::default(),
        // What `sluice train` would run, not every placement the planner can model.
        supports: STREAMER,
        gpus,
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
