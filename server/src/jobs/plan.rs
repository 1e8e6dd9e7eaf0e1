//! The planner's verdict on a job, in the API's shape: will it fit, how is memory split across
//! tiers, how long is a step, where will everything live, and the `sluice train` line for the
//! same job. `POST /api/plan` answers with it, and a submit is refused when it does not fit.
//!
//! The answer is the engine's planner (`sluice_engine::plan`) for the engine's job, on the GPU
//! as on the CPU, with the capabilities the streamer implements: the placement a job will run
//! with is exactly the one shown. Handlers never open the GPU, so a GPU's free memory comes
//! from NVML here; the runner plans again against the driver's figure when the job starts.

use serde::Serialize;
use sluice_engine::plan::{self, MachineMemory, MemorySource};
use sluice_engine::spec::ModelSpec;
use sluice_engine::train::{Devices, Job, RunPlacement};

use crate::AppState;
use crate::error::{ApiError, ApiResult};

#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    pub fits: bool,
    /// One sentence for the user: why it fits or what does not, and what would.
    pub reason: String,
    pub tiers: Vec<Tier>,
    /// Predicted seconds per optimizer step.
    pub step_time_s: Option<f64>,
    /// What limits the step time: "pcie", "gpu_compute" or "cpu_adam".
    pub bottleneck: String,
    /// Where everything lives, one line (see `RunPlacement::describe`).
    pub placement: Option<String>,
    /// The equivalent `sluice train` command line.
    pub command: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Tier {
    /// "device", "pinned host", "pageable host", or "host" on the CPU.
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
pub fn machine_memory(state: &AppState, devices: &Devices) -> ApiResult<MachineMemory> {
    let (_, host_available) = crate::gpus::host_memory();
    let host_bytes = state.queue().host_budget(host_available);
    match devices.gpus().first() {
        None => MachineMemory::detect(plan::GpuQuery::HostOnly, None, Some(host_bytes))
            .map_err(|e| ApiError::bad_request(e.to_string())),
        Some(&n) => {
            let id = format!("cuda:{n}");
            let listed = state.gpus().list();
            let gpu = listed
                .iter()
                .find(|d| d.id == id)
                .ok_or_else(|| ApiError::bad_request(format!("unknown GPU {id:?}")))?;
            Ok(MachineMemory {
                gpu_bytes: gpu.memory_total.saturating_sub(gpu.memory_used),
                gpu_source: MemorySource::Measured,
                gpu_total: Some(gpu.memory_total),
                host_bytes,
                host_source: MemorySource::Measured,
                host_total: None,
            })
        }
    }
}

/// The engine planner's verdict on `job` with `memory`, in the API's shape.
pub fn verdict(job: &Job, spec: &ModelSpec, memory: MachineMemory) -> Verdict {
    let shared = memory.shared();
    let command = crate::cli::train::command_line(job);
    let tiers = |b: &plan::Budget| -> Vec<Tier> {
        let convert = |t: &plan::Tier| Tier {
            name: t.tier.label().into(),
            capacity: t.capacity,
            used: t.used,
            parts: t.parts.iter().map(|p| Part { name: p.name.clone(), bytes: p.bytes }).collect(),
        };
        if shared {
            // The CPU backend: what a GPU would hold is host memory too; one tier.
            let mut parts = Vec::new();
            for t in [&b.device, &b.pinned_host, &b.pageable_host] {
                parts.extend(t.parts.iter().map(|p| Part { name: p.name.clone(), bytes: p.bytes }));
            }
            let used = b.device.used + b.host_used();
            vec![Tier { name: "host".into(), capacity: b.host_capacity, used, parts }]
        } else {
            vec![convert(&b.device), convert(&b.pinned_host), convert(&b.pageable_host)]
        }
    };
    match plan::plan(&job.plan_input(spec, memory)) {
        Ok(plan::Verdict::Fits(p)) => {
            let placement = RunPlacement::of(&p).map(|r| r.describe(p.model.units));
            Verdict {
                fits: true,
                reason: format!(
                    "fits: {:.2} s per step predicted, bound by {}",
                    p.time.total_s,
                    bottleneck(p.time.bottleneck)
                ),
                tiers: tiers(&p.budget),
                step_time_s: Some(p.time.total_s),
                bottleneck: serde_json::to_value(p.time.bottleneck)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default(),
                placement: placement.ok(),
                command,
            }
        }
        Ok(plan::Verdict::Refused(r)) => Verdict {
            fits: false,
            reason: format!("does not fit: {r}"),
            tiers: tiers(&r.budget),
            step_time_s: None,
            bottleneck: String::new(),
            placement: None,
            command,
        },
        Err(e) => Verdict {
            fits: false,
            reason: e.to_string(),
            tiers: Vec::new(),
            step_time_s: None,
            bottleneck: String::new(),
            placement: None,
            command,
        },
    }
}

fn bottleneck(b: plan::Bottleneck) -> &'static str {
    match b {
        plan::Bottleneck::Pcie => "PCIe transfers",
        plan::Bottleneck::GpuCompute => "GPU compute",
        plan::Bottleneck::CpuAdam => "the CPU optimizer",
    }
}
