//! The planner's verdict on a job, in the API's shape: will it fit, how is memory split across
//! tiers, how long is a step, where will everything live, and the `sluice train` line for the
//! same job. `POST /api/plan` answers with it, and a submit is refused when it does not fit.
//!
//! The answer is the engine's planner (`sluice_engine::plan`) for the engine's job, on the GPU
//! as on the CPU, with the capabilities the streamer implements: the placement a job will run
//! with is exactly the one shown. Handlers never open the GPU, so a GPU's free memory comes
//! from NVML here; the runner plans again against the driver's figure when the job starts.
//! The disk tier (`DATA_DIR/disk-tier`) is part of the machine where the job's verdict
//! depends on it ([`super::disk`]).

use serde::Serialize;
use sluice_engine::placement::GradientTier;
use sluice_engine::plan::{self, MachineMemory, MemorySource};
use sluice_engine::schedule::from_plan::schedule_options;
use sluice_engine::spec::ModelSpec;
use sluice_engine::train::{Devices, GradientPolicy, Job};

use super::JobsError;
use crate::AppState;

#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    pub fits: bool,
    /// One sentence a non-programmer understands: whether it fits and how long it takes, or
    /// what does not fit and the closest job that would (see [`sentence`]).
    pub reason: String,
    /// The planner's own words, for engineers: the tier that overflows and the flags that fit.
    pub detail: String,
    pub tiers: Vec<Tier>,
    /// Predicted seconds per optimizer step.
    pub step_time_s: Option<f64>,
    /// Predicted seconds for the whole run (`steps` times the step, and the task evaluations),
    /// when the steps are set.
    pub run_time_s: Option<f64>,
    /// The task evaluation's predicted cost, at most, in a sentence; `None` without one.
    pub eval: Option<String>,
    /// Its predicted seconds each time, at most.
    pub eval_time_s: Option<f64>,
    /// The same, in words ("about 7 days").
    pub run_time: Option<String>,
    /// What limits the step time: "pcie", "gpu_compute", "cpu_adam" or "disk" on a GPU; "cpu"
    /// on the processor, where every part of a step is its work.
    pub bottleneck: String,
    /// The closest job that fits when this one does not: one setting changed.
    pub suggestion: Option<Change>,
    /// Where everything lives, one line (see `ScheduleOptions::describe`).
    pub placement: Option<String>,
    /// Where the Adam moments live when some are on the disk tier, a sentence
    /// (`Plan::disk_text`): which units, the folder, the bytes and the disk's time per step.
    pub disk: Option<String>,
    /// The equivalent `sluice train` command line.
    pub command: String,
    /// The job planned with each gradient policy, most exact first: what choosing between
    /// them costs in memory and time, and what each does to the results.
    pub gradient_options: Vec<GradientChoice>,
}

/// One gradient policy for this job.
#[derive(Debug, Clone, Serialize)]
pub struct GradientChoice {
    /// The job's `gradients` value that asks for it, or "no_clip" (`max_grad_norm` 0).
    pub policy: String,
    /// Whether the job as asked runs with it.
    pub chosen: bool,
    #[serde(flatten)]
    pub option: plan::GradientOption,
}

/// One setting of the job changed to make it fit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Change {
    /// The job's field: "micro_batch" or "grad_accum".
    pub field: &'static str,
    pub value: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct Tier {
    /// "device", "pinned host", "pageable host", or "host" on the CPU; then "disk tier" where
    /// the machine has one.
    pub name: String,
    pub capacity: u64,
    pub used: u64,
    pub parts: Vec<Part>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Part {
    pub name: String,
    pub bytes: u64,
}

/// The memory a job on `devices` may use now: the first GPU's free memory as NVML reports it
/// (each GPU of a data-parallel job plans its own share) and MemAvailable.
pub fn machine_memory(state: &AppState, devices: &Devices) -> Result<MachineMemory, JobsError> {
    let (_, host_available) = crate::gpus::host_memory();
    let host_bytes = state.queue().host_budget(host_available);
    match devices.gpus().first() {
        None => MachineMemory::detect(plan::GpuQuery::HostOnly, None, Some(host_bytes))
            .map_err(|e| JobsError::invalid(e.to_string())),
        Some(&n) => {
            let id = format!("cuda:{n}");
            let listed = state.gpus().list();
            let gpu = listed
                .iter()
                .find(|d| d.id == id)
                .ok_or_else(|| JobsError::invalid(format!("unknown GPU {id:?}")))?;
            Ok(MachineMemory {
                gpu_bytes: gpu.memory_total.saturating_sub(gpu.memory_used),
                gpu_source: MemorySource::Measured,
                gpu_total: Some(gpu.memory_total),
                host_bytes,
                host_source: MemorySource::Measured,
                host_total: None,
                disk: None,
            })
        }
    }
}

/// `memory` with the appliance's disk tier where `job`'s verdict depends on one
/// ([`super::disk::attach`]); 400 when the job asks for a disk tier that cannot be used.
pub fn with_disk_tier(
    state: &AppState,
    job: &Job,
    spec: &ModelSpec,
    memory: MachineMemory,
) -> Result<MachineMemory, JobsError> {
    super::disk::attach(&state.config().disk_tier_dir(), job, spec, memory)
        .map_err(JobsError::Invalid)
}

/// The engine planner's verdict on `job` with `memory`, in the API's shape.
pub fn verdict(job: &Job, spec: &ModelSpec, memory: MachineMemory) -> Verdict {
    let shared = memory.shared();
    let mut command = crate::job_line::command_line(job);
    // The same job from a terminal needs the same disk tier.
    if let Some(d) = &memory.disk {
        command.push_str(" --disk-dir ");
        command.push_str(&crate::job_line::shell_quote(&d.dir.display().to_string()));
    }
    let input = job.plan_input(spec, memory);
    let mut planned = plan::plan(&input);
    if let Ok(plan::Verdict::Fits(p)) = &mut planned {
        p.eval = job.eval_plan(spec);
    }
    let steps = job.settings.steps;
    let chosen = match &planned {
        Ok(plan::Verdict::Fits(p)) => Some(p.placement.gradients),
        _ => None,
    };
    let mut verdict = Verdict {
        fits: false,
        reason: String::new(),
        detail: String::new(),
        tiers: Vec::new(),
        step_time_s: None,
        run_time_s: None,
        eval: None,
        eval_time_s: None,
        run_time: None,
        bottleneck: String::new(),
        suggestion: None,
        placement: None,
        disk: None,
        command,
        gradient_options: plan::gradient_options(&input)
            .unwrap_or_default()
            .into_iter()
            .map(|mut option| {
                // On the processor the "device" store is plain memory beside the weights.
                if shared && option.gradients == GradientTier::DeviceStore {
                    option.effect = "exact clipping; fp32 gradients wait beside the weights \
                                     in memory (4 bytes per parameter)";
                }
                GradientChoice {
                    policy: GradientPolicy::asking_for(option.gradients)
                        .map_or("no_clip".into(), |p| p.to_string()),
                    chosen: chosen == Some(option.gradients),
                    option,
                }
            })
            .collect(),
    };
    match &planned {
        Ok(plan::Verdict::Fits(p)) => {
            verdict.fits = true;
            verdict.detail = format!(
                "fits: {:.2} s per step predicted, bound by {}",
                p.time.total_s,
                bottleneck(p.time.bottleneck)
            );
            verdict.tiers = shown_tiers(&p.budget, shared);
            verdict.step_time_s = Some(p.time.total_s);
            verdict.run_time_s = run_time_s(p, steps);
            verdict.run_time = verdict.run_time_s.map(about);
            verdict.eval = p.eval.as_ref().map(plan::EvalPlan::text);
            verdict.eval_time_s = p.eval.as_ref().map(|e| e.each.seconds);
            verdict.bottleneck = if shared {
                "cpu".into()
            } else {
                serde_json::to_value(p.time.bottleneck)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default()
            };
            verdict.placement = schedule_options(p, 0).map(|o| o.describe(p.model.units)).ok();
            verdict.disk = p.disk_text();
        }
        Ok(plan::Verdict::Refused(r)) => {
            verdict.detail = format!("does not fit: {r}");
            verdict.tiers = shown_tiers(&r.budget, shared);
            verdict.suggestion = closest(r);
        }
        Err(e) => verdict.detail = e.to_string(),
    }
    verdict.reason = match &planned {
        Ok(v) => sentence(v, &job.devices, steps),
        Err(e) => e.to_string(),
    };
    verdict
}

/// The tiers as the web shows them and `sluice plan` totals them: on the CPU one "host" tier
/// (what a GPU would hold is host memory too), else the device, pinned and pageable host; then
/// the disk tier where the machine has one.
pub fn shown_tiers(b: &plan::Budget, shared: bool) -> Vec<Tier> {
    let parts = |t: &plan::Tier| -> Vec<Part> {
        t.parts.iter().map(|p| Part { name: p.name.clone(), bytes: p.bytes }).collect()
    };
    let tier = |t: &plan::Tier| Tier {
        name: t.tier.label().into(),
        capacity: t.capacity,
        used: t.used,
        parts: parts(t),
    };
    let mut tiers = if shared {
        let mut all = Vec::new();
        for t in [&b.device, &b.pinned_host, &b.pageable_host] {
            all.extend(parts(t));
        }
        let used = b.device.used + b.host_used();
        vec![Tier { name: "host".into(), capacity: b.host_capacity, used, parts: all }]
    } else {
        vec![tier(&b.device), tier(&b.pinned_host), tier(&b.pageable_host)]
    };
    tiers.extend(b.disk.as_ref().map(tier));
    tiers
}

fn run_time_s(p: &plan::Plan, steps: Option<u64>) -> Option<f64> {
    let evaluations = p.eval.as_ref().and_then(plan::EvalPlan::total_s).unwrap_or(0.0);
    steps.map(|n| p.time.total_s * n as f64 + evaluations).filter(|t| t.is_finite())
}

/// The job that comes closest to the one asked while fitting: the largest micro-batch that
/// fits, else the most micro-batches per step (the engine's suggestions, in its order).
pub fn closest(r: &plan::Refusal) -> Option<Change> {
    r.fits.iter().find_map(|s| match *s {
        plan::Suggestion::MicroBatch(m) => Some(Change { field: "micro_batch", value: m }),
        plan::Suggestion::GradAccum(g) => Some(Change { field: "grad_accum", value: g }),
        plan::Suggestion::HostMemory(_)
        | plan::Suggestion::GpuMemory(_)
        | plan::Suggestion::DiskSpace(_) => None,
    })
}

/// Bytes as GiB with one decimal ("127.7 GiB"), MiB below one GiB: binary units, as the plan
/// card's bars show them too.
pub fn gib(bytes: u64) -> String {
    let b = bytes as f64;
    if bytes >= 1 << 30 {
        format!("{:.1} GiB", b / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", b / (1u64 << 20) as f64)
    }
}

/// A predicted duration in words: "about 40 seconds", "about 12 minutes", "about 3 h 20 min",
/// "about 7 days" (days past 24 hours).
pub fn about(seconds: f64) -> String {
    if !seconds.is_finite() || seconds < 0.0 {
        return "an unknown time".into();
    }
    if seconds < 1.0 {
        return "under a second".into();
    }
    let plural =
        |n: u64, one: &str| if n == 1 { format!("1 {one}") } else { format!("{n} {one}s") };
    if seconds < 90.0 {
        return format!("about {}", plural(seconds.round() as u64, "second"));
    }
    let minutes = (seconds / 60.0).round() as u64;
    if minutes < 60 {
        return format!("about {}", plural(minutes, "minute"));
    }
    let hours = seconds / 3600.0;
    if hours < 24.0 {
        let (h, m) = (minutes / 60, minutes % 60);
        return if m == 0 { format!("about {h} h") } else { format!("about {h} h {m} min") };
    }
    let days = hours / 24.0;
    if days < 10.0 {
        let tenths = (days * 10.0).round() / 10.0;
        if tenths.fract() == 0.0 {
            format!("about {}", plural(tenths as u64, "day"))
        } else {
            format!("about {tenths:.1} days")
        }
    } else {
        format!("about {}", plural(days.round() as u64, "day"))
    }
}

/// Where a job runs, as the sentence says it.
fn on(devices: &Devices) -> String {
    match devices.gpus().len() {
        0 => "on this processor".into(),
        1 => "on this GPU".into(),
        n => format!("on these {n} GPUs"),
    }
}

/// Models below this many parameters gain nothing from "try the tiny model".
const SMALL_MODEL_PARAMS: u64 = 10_000_000;

/// Runs longer than this get advice on making them shorter.
const LONG_RUN_S: f64 = 24.0 * 3600.0;

/// The verdict in one sentence for someone who does not know what a micro-batch is, with the
/// figures `sluice plan` prints: "Fits, about 7 days on this processor: try a GPU or the tiny
/// model." or "Does not fit: needs 127.7 GiB of host memory, 124.5 GiB free. The closest job
/// that fits: micro-batch 4." `steps` is the run's length, when it is known.
pub fn sentence(verdict: &plan::Verdict, devices: &Devices, steps: Option<u64>) -> String {
    match verdict {
        plan::Verdict::Fits(p) => {
            let small = p.model.params < SMALL_MODEL_PARAMS;
            match run_time_s(p, steps) {
                Some(total) => {
                    let advice = match (devices.gpus().is_empty(), total > LONG_RUN_S) {
                        (true, true) if small => ": try a GPU or fewer steps",
                        (true, true) => ": try a GPU or the tiny model",
                        (false, true) => ": fewer steps or shorter sequences would be quicker",
                        (_, false) => "",
                    };
                    format!("Fits, {} {}{advice}.", about(total), on(devices))
                }
                None => format!(
                    "Fits, {} a step {}; the whole run depends on the data's length.",
                    about(p.time.total_s),
                    on(devices)
                ),
            }
        }
        plan::Verdict::Refused(r) => {
            let memory = |m: plan::Memory| match m {
                plan::Memory::Device => "GPU memory",
                plan::Memory::Host => "host memory",
                plan::Memory::Disk => "disk tier space",
            };
            let needs = r
                .overflows
                .iter()
                .map(|o| {
                    format!(
                        "needs {} of {}, {} free",
                        gib(o.needed),
                        memory(o.memory),
                        gib(o.capacity)
                    )
                })
                .collect::<Vec<_>>()
                .join("; ");
            let closer = match closest(r) {
                Some(Change { field: "micro_batch", value }) => {
                    format!("The closest job that fits: micro-batch {value}.")
                }
                Some(Change { value, .. }) => format!(
                    "The closest job that fits: {value} micro-batch{} per step.",
                    if value == 1 { "" } else { "es" }
                ),
                None => {
                    let more = r.fits.iter().find_map(|s| match *s {
                        plan::Suggestion::HostMemory(b) => {
                            Some(format!("{} of host memory", gib(b)))
                        }
                        plan::Suggestion::GpuMemory(b) => {
                            Some(format!("a GPU with {} free", gib(b)))
                        }
                        plan::Suggestion::DiskSpace(b) => {
                            Some(format!("{} free on the disk tier", gib(b)))
                        }
                        _ => None,
                    });
                    match more {
                        Some(more) => format!(
                            "No smaller batch fits: try a smaller model, or a machine with {more}."
                        ),
                        None => "No smaller batch fits: try a smaller model.".into(),
                    }
                }
            };
            format!("Does not fit: {needs}. {closer}")
        }
    }
}

fn bottleneck(b: plan::Bottleneck) -> &'static str {
    match b {
        plan::Bottleneck::Pcie => "PCIe transfers",
        plan::Bottleneck::GpuCompute => "GPU compute",
        plan::Bottleneck::CpuAdam => "the CPU optimizer",
        plan::Bottleneck::Disk => "the disk tier's reads and writes",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_people_say_them() {
        assert_eq!(about(0.2), "under a second");
        assert_eq!(about(40.0), "about 40 seconds");
        assert_eq!(about(12.0 * 60.0), "about 12 minutes");
        assert_eq!(about(3600.0), "about 1 h");
        assert_eq!(about(3.0 * 3600.0 + 20.0 * 60.0), "about 3 h 20 min");
        assert_eq!(about(168.0 * 3600.0), "about 7 days");
        assert_eq!(about(36.0 * 3600.0), "about 1.5 days");
        assert_eq!(about(24.0 * 3600.0 * 30.4), "about 30 days");
        assert_eq!(about(f64::NAN), "an unknown time");
    }

    #[test]
    fn sizes_are_gib() {
        assert_eq!(gib(0), "0.0 MiB");
        assert_eq!(gib(1536 << 10), "1.5 MiB");
        assert_eq!(gib(127_700 << 20), "124.7 GiB");
        assert_eq!(gib(3 << 30), "3.0 GiB");
    }
}
