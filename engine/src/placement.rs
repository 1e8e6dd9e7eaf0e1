//! Placements are plain values: the planner ([`crate::plan`]) chooses them and the streamer
//! ([`crate::schedule`]) runs them, so both depend on this module and not on each other.

use serde::{Deserialize, Serialize};

/// Where unit-input checkpoints (the per-micro-batch layer inputs) live between the forward and
/// the backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CheckpointTier {
    Device,
    /// Pinned host memory: each checkpoint goes down in the forward and back up in the backward.
    Host,
}

/// Where weight gradients wait before the optimizer uses them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GradientTier {
    /// Clipping on: every unit's fp32 gradients stay on the device until the global norm is
    /// known, then ship in forward order.
    DeviceStore,
    /// Clipping on: gradients ship as each unit finishes and wait in a pinned host store.
    HostStore,
    /// Clipping on: as the host store, but each unit's gradients are rounded to bf16 on the
    /// device after their sum of squares is taken in fp32 (the norm, and so the clipping, stay
    /// exact; AdamW sees gradients to bf16's 8 bits of mantissa): half the host bytes and the
    /// PCIe bytes down. Only where no fp32 store fits.
    HostStoreBf16,
    /// Clipping off: gradients land in a two-slot pinned ring and are consumed at once.
    HostRing,
}

impl GradientTier {
    /// Every tier, most exact first.
    pub const ALL: [GradientTier; 4] = [
        GradientTier::DeviceStore,
        GradientTier::HostStore,
        GradientTier::HostStoreBf16,
        GradientTier::HostRing,
    ];

    /// Whether the tier waits for the global norm (clipping on) or feeds AdamW at once.
    pub fn clips(self) -> bool {
        self != GradientTier::HostRing
    }

    /// What the tier does to the results, in a clause a user can weigh.
    pub fn effect(self) -> &'static str {
        match self {
            GradientTier::DeviceStore => {
                "exact clipping; fp32 gradients wait in GPU memory (4 bytes per parameter there)"
            }
            GradientTier::HostStore => {
                "exact clipping; fp32 gradients wait in host memory (4 bytes per parameter)"
            }
            GradientTier::HostStoreBf16 => {
                "exact clipping (the norm is taken in fp32); AdamW sees gradients rounded to \
                 bf16 (2 host bytes per parameter)"
            }
            GradientTier::HostRing => {
                "no clipping: no step is limited by the gradient norm; gradients go straight \
                 into AdamW (a small ring, no store)"
            }
        }
    }
}

/// Where the weights that cross PCIe come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightSource {
    /// A copy in the device's weight dtype (bf16 on GPUs) in pinned host memory, rewritten by
    /// every update: 2 more host bytes per parameter, 2 bytes per parameter across PCIe.
    StreamingCopy,
    /// The fp32 master weights themselves, pinned, cast to the device's dtype as they arrive:
    /// no second copy on the host, 4 bytes per parameter across PCIe (a GPU's cast is exact,
    /// round to nearest even as the host's copy, so training is bit for bit the same).
    Master,
}

impl WeightSource {
    /// Bytes per parameter that cross PCIe per upload (and that the source holds on the host).
    pub fn bytes(self) -> u64 {
        match self {
            WeightSource::StreamingCopy => 2, // bf16
            WeightSource::Master => 4,        // f32
        }
    }
}

/// Most logits the LM head's chunked cross-entropy materialises at once on a GPU (`[chunk, V]`
/// f32 logits plus their bf16 gradient: 1.5 GiB), so a chunk is `LOSS_CHUNK_LOGITS / V` tokens
/// (1765 at a 152k vocabulary). Each chunk adds the whole `[V, H]` f32 weight gradient into its
/// accumulator once, so larger chunks read and write it less often: on the H200 (Qwen2.5-7B,
/// 2026-12-03) 2^28 took the head's forward and backward from 0.627 s to 0.504 s a step
/// against 2^26.
pub const LOSS_CHUNK_LOGITS: usize = 1 << 28;

/// Query-key pairs a causal sequence of `s` tokens computes with an optional sliding window
/// `w` (token `i` sees `min(i + 1, w)` keys). One document per row: packed documents only
/// lower it, so this is the upper bound. The planner prices attention by it and the GPU
/// profile counts attention FLOPs by it.
pub fn causal_pairs(s: u64, window: Option<u64>) -> u64 {
    let full = s * (s + 1) / 2;
    match window {
        Some(w) if w < s => w * (w + 1) / 2 + (s - w) * w,
        _ => full,
    }
}

/// Slots of the host gradient ring unless host memory is short: the updates that may be queued
/// or running while the next unit's gradients land.
pub const RING_SLOTS: usize = 4;

/// Elements of fp32 master weights staged on the device per cast when weights stream from the
/// master: 128 MiB, large enough that a copy's setup is noise next to its bytes (a 7B layer is
/// seven chunks) and small next to the weight slots. Each chunk's cast waits for its copy and
/// the next copy for the cast, so the casts (at device memory speed) add about 2% to the copy
/// engine's time.
pub const CAST_CHUNK: usize = 32 << 20;

/// Where a memory capacity came from, so the output can say when it is an assumption.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MemorySource {
    /// Given by the caller (a command-line flag or the web form).
    Given,
    /// Read from the machine: the host's MemAvailable (`/proc/meminfo`), a GPU's free memory
    /// (the driver's `cuMemGetInfo`, or NVML's total less used).
    Measured,
    /// No GPU could be read: the H200 figure is assumed.
    AssumedH200,
    /// The CPU backend: there is no device memory, the buffers a GPU would hold are host memory
    /// too, so the device's capacity is whatever the host parts of the plan leave.
    SharedWithHost,
}

/// The disk tier's folder, its free space and its direct-I/O rates
/// ([`crate::store::disk::probe`] measures them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DiskSpace {
    /// The folder the tier's file is created in (on a local SSD).
    pub dir: std::path::PathBuf,
    /// Bytes the tier may use there.
    pub bytes: u64,
    /// Sequential direct-I/O rates with the tier's requests in flight, bytes per second.
    pub read_bytes_per_s: u64,
    pub write_bytes_per_s: u64,
    pub source: MemorySource,
}
