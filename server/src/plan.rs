//! `POST /api/plan`: will it fit, how is memory split across tiers, how long is a step.
//!
//! On a GPU, [`plan_verdict`] is the engine's planner (`sluice_engine::plan`: placement, device
//! / pinned / pageable budgets, predicted step time and bottleneck), translated to the API's
//! shape. On the CPU, where nothing streams, it is a coarse estimate from the parameter count:
//! host memory for weights, gradients and Adam moments plus activations, and a flat throughput.

use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use sluice_engine::spec::ModelSpec;

use crate::AppState;
use crate::auth::CurrentUser;
use crate::error::{ApiError, ApiJson, ApiResult};
use crate::gpus::DeviceInfo;
use crate::models;

pub(crate) fn router() -> Router<AppState> {
    Router::new().route("/api/plan", post(plan))
}

/// What the planner is asked.
#[derive(Debug, Clone, Copy)]
pub struct PlanInput<'a> {
    pub spec: &'a ModelSpec,
    pub device: &'a DeviceInfo,
    /// Host memory available to a job (MemAvailable), bytes.
    pub host_memory: u64,
    pub seq_len: usize,
    pub micro_batch: usize,
    pub grad_accum: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    pub fits: bool,
    /// One sentence for the user: why it fits or what does not.
    pub reason: String,
    pub tiers: Vec<Tier>,
    /// Predicted seconds per optimizer step.
    pub step_time_s: Option<f64>,
    /// What limits the step time: "compute" or "pcie".
    pub bottleneck: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Tier {
    /// "gpu" or "host".
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

/// Rough sustained throughput of the CPU backend (FLOP/s).
const CPU_FLOPS: f64 = 2e10;

/// The verdict for a job (see the module comment).
pub fn plan_verdict(input: &PlanInput) -> Verdict {
    if input.device.id != "cpu" {
        return engine_verdict(input);
    }
    let spec = input.spec;
    let n = spec.total_params() as u64;
    let tokens = (input.micro_batch * input.seq_len) as u64;
    let f32b = 4u64;
    let activations = Part {
        name: "activations".into(),
        // Checkpointed layer inputs plus one layer's working set.
        bytes: tokens
            * f32b
            * (spec.hidden * spec.layers + 4 * spec.hidden + 3 * spec.intermediate) as u64
            + (input.micro_batch * spec.q_heads * input.seq_len * input.seq_len) as u64 * f32b,
    };
    let logits = Part { name: "logits".into(), bytes: 2 * tokens * spec.vocab as u64 * f32b };
    let host_parts = vec![
        Part { name: "fp32 weights".into(), bytes: 4 * n },
        Part { name: "fp32 gradients".into(), bytes: 4 * n },
        Part { name: "Adam moments (fp32)".into(), bytes: 8 * n },
        activations,
        logits,
    ];
    let tiers = vec![tier("host", input.host_memory, host_parts)];
    let flops = 6.0 * n as f64 * tokens as f64 * input.grad_accum as f64;
    let (step_time_s, bottleneck) = (flops / CPU_FLOPS, "compute");

    let over: Vec<&Tier> = tiers.iter().filter(|t| t.used > t.capacity).collect();
    let fits = over.is_empty();
    let reason = if fits {
        let summary: Vec<String> = tiers
            .iter()
            .map(|t| format!("{} of {} {}", gib(t.used), gib(t.capacity), t.name))
            .collect();
        format!("fits: {} (estimate from the parameter count)", summary.join(", "))
    } else {
        let summary: Vec<String> = over
            .iter()
            .map(|t| format!("{} memory needs {} but has {}", t.name, gib(t.used), gib(t.capacity)))
            .collect();
        format!("does not fit: {}", summary.join("; "))
    };
    Verdict { fits, reason, tiers, step_time_s: Some(step_time_s), bottleneck: bottleneck.into() }
}

/// The engine's planner for a GPU job.
fn engine_verdict(input: &PlanInput) -> Verdict {
    use sluice_engine::plan::{self, BatchShape, MachineMemory, MachineRates, MemorySource};
    let request = plan::PlanInput {
        spec: input.spec,
        batch: BatchShape {
            seq_len: input.seq_len,
            micro_batch: input.micro_batch,
            grad_accum: input.grad_accum,
        },
        clipping: true,
        // Free GPU memory (NVML's total less used) and MemAvailable, as `sluice plan` and
        // `sluice train` read them (see `MachineMemory::detect`).
        memory: MachineMemory {
            gpu_bytes: input.device.memory_total.saturating_sub(input.device.memory_used),
            gpu_source: MemorySource::Measured,
            gpu_total: Some(input.device.memory_total),
            host_bytes: input.host_memory,
            host_source: MemorySource::Measured,
            host_total: None,
        },
        rates: MachineRates::default(),
        supports: crate::jobs::RUNNER,
        gpus: 1,
    };
    let convert = |t: &plan::Tier| Tier {
        name: t.tier.label().into(),
        capacity: t.capacity,
        used: t.used,
        parts: t.parts.iter().map(|p| Part { name: p.name.clone(), bytes: p.bytes }).collect(),
    };
    match plan::plan(&request) {
        Ok(plan::Verdict::Fits(p)) => {
            let b = &p.budget;
            Verdict {
                fits: true,
                reason: format!(
                    "fits: {} units resident, checkpoints {:?}, {:.2} s per step predicted",
                    p.placement.resident_units.len(),
                    p.placement.checkpoints,
                    p.time.total_s
                )
                .to_lowercase(),
                tiers: vec![convert(&b.device), convert(&b.pinned_host), convert(&b.pageable_host)],
                step_time_s: Some(p.time.total_s),
                bottleneck: format!("{:?}", p.time.bottleneck).to_lowercase(),
            }
        }
        Ok(plan::Verdict::Refused(r)) => {
            let b = &r.budget;
            Verdict {
                fits: false,
                reason: r.reason.clone(),
                tiers: vec![convert(&b.device), convert(&b.pinned_host), convert(&b.pageable_host)],
                step_time_s: None,
                bottleneck: String::new(),
            }
        }
        Err(e) => Verdict {
            fits: false,
            reason: e.to_string(),
            tiers: Vec::new(),
            step_time_s: None,
            bottleneck: String::new(),
        },
    }
}

fn tier(name: &str, capacity: u64, parts: Vec<Part>) -> Tier {
    Tier { name: name.into(), capacity, used: parts.iter().map(|p| p.bytes).sum(), parts }
}

fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanRequest {
    pub model: String,
    pub gpu: String,
    #[serde(default = "default_seq_len")]
    pub seq_len: usize,
    #[serde(default = "default_micro_batch")]
    pub micro_batch: usize,
    #[serde(default = "default_grad_accum")]
    pub grad_accum: usize,
}

pub fn default_seq_len() -> usize {
    256
}

pub fn default_micro_batch() -> usize {
    4
}

pub fn default_grad_accum() -> usize {
    1
}

/// Resolves the model and device of a request and runs the planner: 400 for an unknown model or
/// device or a zero size.
pub fn verdict_for(
    state: &AppState,
    model: &str,
    gpu: &str,
    seq_len: usize,
    micro_batch: usize,
    grad_accum: usize,
) -> ApiResult<Verdict> {
    for (what, value) in
        [("seq_len", seq_len), ("micro_batch", micro_batch), ("grad_accum", grad_accum)]
    {
        if value == 0 {
            return Err(ApiError::bad_request(format!("{what} must be at least 1")));
        }
    }
    let model = models::resolve(state, model)?;
    let devices = state.gpus().list();
    let Some(device) = devices.iter().find(|d| d.id == gpu) else {
        let known: Vec<&str> = devices.iter().map(|d| d.id.as_str()).collect();
        return Err(ApiError::bad_request(format!(
            "unknown GPU {gpu:?} (this machine has: {})",
            known.join(", ")
        )));
    };
    // MemAvailable, not MemTotal: what other processes hold is not the job's to use.
    let (_, host_memory) = crate::gpus::host_memory();
    Ok(plan_verdict(&PlanInput {
        spec: &model.spec,
        device,
        host_memory,
        seq_len,
        micro_batch,
        grad_accum,
    }))
}

async fn plan(
    State(state): State<AppState>,
    _user: CurrentUser,
    ApiJson(body): ApiJson<PlanRequest>,
) -> ApiResult<Json<Verdict>> {
    let verdict = tokio::task::spawn_blocking(move || {
        verdict_for(&state, &body.model, &body.gpu, body.seq_len, body.micro_batch, body.grad_accum)
    })
    .await??;
    Ok(Json(verdict))
}
