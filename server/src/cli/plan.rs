//! `sluice plan`: where a training job's bytes would live, what a step would cost, or why the
//! job does not fit and what would. The first line is the sentence the web form shows for the
//! same job (`jobs::plan::sentence`), from the same plan: the job is planned exactly as
//! `sluice train` and the appliance plan it (`Job::plan_input`).

use std::path::PathBuf;

use sluice_engine::data::DatasetSource;
use sluice_engine::eval::EvalMetric;
use sluice_engine::plan::{
    GpuQuery, GradientOption, GradientTier, Verdict, gradient_options, plan,
};
use sluice_engine::spec::{ModelSpec, preset};
use sluice_engine::train::{Devices, GradientPolicy, Job, JobSettings, Limits, ModelSource};

use super::shape::ShapeArgs;
use crate::jobs::plan::{gib, sentence};

#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["model", "preset"])))]
pub(crate) struct PlanArgs {
    #[command(flatten)]
    shape: ShapeArgs,

    /// Optimizer steps of the run, to predict its whole duration [default: unknown, one pass
    /// over the data].
    #[arg(long)]
    steps: Option<u64>,

    /// Plan with global-norm gradient clipping off (gradients then need no store).
    #[arg(long, conflicts_with = "gradients")]
    no_clip: bool,

    /// Where gradients wait for the norm: auto, device, host or host-bf16, as `sluice train
    /// --gradients` [default: auto]. Every policy is listed after the plan either way.
    #[arg(long, value_name = "POLICY")]
    gradients: Option<GradientPolicy>,

    /// A task evaluation between steps, as `sluice train --eval-metric`: the plan leaves it
    /// device memory and predicts its time [default: loss, none].
    #[arg(long, value_name = "METRIC")]
    eval_metric: Option<EvalMetric>,

    /// Evaluate every this many steps (besides before the first and after the last).
    #[arg(long, value_name = "STEPS")]
    eval_every: Option<u64>,

    /// Records each task evaluation scores [default: 200].
    #[arg(long, value_name = "N")]
    eval_records: Option<usize>,

    /// Tokens an answer may take [default: 128].
    #[arg(long, value_name = "N")]
    eval_max_new_tokens: Option<usize>,

    /// Print the plan as JSON (the engine planner's format).
    #[arg(long)]
    json: bool,
}

pub(crate) fn run(args: PlanArgs) -> anyhow::Result<()> {
    let source = args.shape.source()?;
    let spec = match &source {
        ModelSource::Dir(dir) => ModelSpec::from_path(dir)?,
        ModelSource::Preset(name) => preset(name)?,
    };
    // Without --device: the first GPU, or an H200 when none can be read.
    let (gpu, devices) = match &args.shape.device {
        None => (GpuQuery::FirstOrH200, Devices::Cuda(vec![0])),
        Some(devices) => (devices.gpu_query(), devices.clone()),
    };
    let d = JobSettings::default();
    let moments = args.shape.moments.unwrap_or(d.moments);
    let memory = args.shape.memory(gpu, moments)?;
    let batch = args.shape.batch();
    // The job `sluice train` would run with these flags; planning reads no data.
    let job = Job {
        model: source,
        data: DatasetSource::File(PathBuf::new()),
        eval_data: None,
        devices,
        settings: JobSettings {
            seq_len: batch.seq_len,
            micro_batch: batch.micro_batch,
            grad_accum: batch.grad_accum,
            steps: args.steps,
            max_grad_norm: if args.no_clip { 0.0 } else { d.max_grad_norm },
            gradients: args.gradients.unwrap_or(d.gradients),
            moments,
            eval_metric: args.eval_metric.unwrap_or(d.eval_metric),
            eval_every: args.eval_every,
            eval_records: args.eval_records.unwrap_or(d.eval_records),
            eval_max_new_tokens: args.eval_max_new_tokens.unwrap_or(d.eval_max_new_tokens),
            ..d
        },
    };
    job.settings.validate(&Limits::default())?;
    let input = job.plan_input(&spec, memory);
    let mut verdict = plan(&input)?;
    if let Verdict::Fits(p) = &mut verdict {
        p.eval = job.eval_plan(&spec);
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&verdict)?);
        return match verdict {
            Verdict::Fits(_) => Ok(()),
            Verdict::Refused(r) => Err(anyhow::anyhow!("does not fit: {r}")),
        };
    }
    println!("{}\n", sentence(&verdict, &job.devices, job.settings.steps));
    let options = gradient_options(&input)?;
    match verdict {
        Verdict::Fits(plan) => {
            println!("{plan}");
            print!("{}", options_table(&options));
            Ok(())
        }
        Verdict::Refused(r) => {
            print!("{}", r.details());
            print!("\n{}", options_table(&options));
            Err(anyhow::anyhow!("does not fit: {r}"))
        }
    }
}

/// Each gradient policy's host memory, step time and effect on the results, one row each.
fn options_table(options: &[GradientOption]) -> String {
    let mut out = String::from("gradient policies (--gradients, or --no-clip for the ring):\n");
    for o in options {
        let name = match o.gradients {
            GradientTier::DeviceStore => "device",
            GradientTier::HostStore => "host",
            GradientTier::HostStoreBf16 => "host-bf16",
            GradientTier::HostRing => "no-clip",
        };
        let disk = if o.disk_bytes > 0 {
            format!(", disk tier {}", gib(o.disk_bytes))
        } else {
            String::new()
        };
        let cost = match (o.step_s, &o.refused) {
            (Some(s), _) => format!(
                "fits: host {} ({:.2} B/param), device {}{disk}, {s:.2} s per step",
                gib(o.host_bytes),
                o.host_bytes_per_param,
                gib(o.device_bytes)
            ),
            (None, reason) => format!("does not fit: {}", reason.as_deref().unwrap_or("")),
        };
        out.push_str(&format!("  {name:<10} {cost}\n  {:<10} {}\n", "", o.effect));
    }
    out
}
