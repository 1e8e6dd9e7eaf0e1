//! `POST /api/plan`: will it fit, how is memory split across tiers, how long is a step.
//!
//! [`plan_verdict`] is a stand-in computed from the parameter count and the shapes until the
//! engine's planner lands; it is the one function to replace. Its numbers are coarse on purpose:
//! host memory is what the optimizer state needs (parameters × 16 bytes on the CPU backend, × 14
//! when a GPU streams the layers), activations are counted at f32, and step time assumes a flat
//! throughput per device.

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
    /// Total memory of the host, bytes.
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
/// Rough sustained throughput of a GPU on bf16 GEMMs (FLOP/s).
const GPU_FLOPS: f64 = 2e14;

/// The stand-in planner (see the module comment).
pub fn plan_verdict(input: &PlanInput) -> Verdict {
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
    let on_gpu = input.device.id != "cpu";
    let mut tiers = Vec::new();
    if on_gpu {
        let layer = spec.layer_params() as u64;
        let gpu_parts = vec![
            Part {
                name: "streamed layers (2 in flight, bf16 weights and grads)".into(),
                bytes: 2 * layer * 2 * 2,
            },
            Part {
                name: "embeddings and head (bf16)".into(),
                bytes: 2 * (spec.vocab * spec.hidden) as u64 * 2,
            },
            activations,
            logits,
        ];
        tiers.push(tier("gpu", input.device.memory_total, gpu_parts));
        let host_parts = vec![
            Part { name: "fp32 master weights".into(), bytes: 4 * n },
            Part { name: "bf16 gradients".into(), bytes: 2 * n },
            Part { name: "Adam moments (fp32)".into(), bytes: 8 * n },
        ];
        tiers.push(tier("host", input.host_memory, host_parts));
    } else {
        let host_parts = vec![
            Part { name: "fp32 weights".into(), bytes: 4 * n },
            Part { name: "fp32 gradients".into(), bytes: 4 * n },
            Part { name: "Adam moments (fp32)".into(), bytes: 8 * n },
            activations,
            logits,
        ];
        tiers.push(tier("host", input.host_memory, host_parts));
    }

    let flops = 6.0 * n as f64 * tokens as f64 * input.grad_accum as f64;
    let (step_time_s, bottleneck) = if on_gpu {
        let compute = flops / GPU_FLOPS;
        // bf16 weights cross twice per micro-batch (forward, recomputing backward), grads once.
        let bytes = (2 * 2 * n * input.grad_accum as u64 + 2 * n) as f64;
        let transfer = bytes / pcie_bytes_per_s(input.device.pcie.as_deref());
        if transfer > compute { (transfer, "pcie") } else { (compute, "compute") }
    } else {
        (flops / CPU_FLOPS, "compute")
    };

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

fn tier(name: &str, capacity: u64, parts: Vec<Part>) -> Tier {
    Tier { name: name.into(), capacity, used: parts.iter().map(|p| p.bytes).sum(), parts }
}

fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// Usable bytes/s of a PCIe link given as "Gen5 x16"; Gen4 x16 when unknown.
fn pcie_bytes_per_s(link: Option<&str>) -> f64 {
    let parse = |link: &str| -> Option<(u32, u32)> {
        let (generation, width) = link.split_once(' ')?;
        Some((
            generation.strip_prefix("Gen")?.parse().ok()?,
            width.strip_prefix('x')?.parse().ok()?,
        ))
    };
    let (generation, width) = link.and_then(parse).unwrap_or((4, 16));
    let per_lane = match generation {
        0..=3 => 0.985e9,
        4 => 1.969e9,
        5 => 3.938e9,
        _ => 7.563e9,
    };
    // About 80% of the raw link rate survives protocol overhead.
    per_lane * f64::from(width.max(1)) * 0.8
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
    let (host_memory, _) = crate::gpus::host_memory();
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
