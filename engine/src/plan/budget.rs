//! Bytes per memory tier for one placement, part by part.

use crate::placement::CAST_CHUNK;
use serde::Serialize;

use super::sizes::{BF16, F32, Sizes, TOKEN_ARRAYS};
use super::{CheckpointTier, GradientTier, WeightSource};

/// Device memory kept back for the CUDA context, cuBLAS workspaces, allocator slack and the
/// temporaries ops allocate as they run (reductions' partial sums, the attention backward's
/// f32 rows): the schedule allocates every buffer at job start, so fragmentation is bounded,
/// but the libraries and those temporaries are not in its buffers. A fixed part plus
/// [`RESERVE_PER_TOKEN_HIDDEN`] bytes per token of a micro-batch and unit of hidden size, fitted
/// to the driver's peak on the H200 (2026-12-04, one session), which these planned parts
/// besides the reserve fell short of by 1.67 GiB at Qwen2.5-1.5B with 8,192 tokens a
/// micro-batch, 1.97 GiB (at 36 GiB) and 2.43 GiB (whole GPU) at 7B with 8,192, and 2.89 GiB at
/// 7B with 32,768: the reserve is 2.34, 2.47 and 3.12 GiB there.
pub const DEVICE_RESERVE: u64 = 9 << 28;
/// See [`DEVICE_RESERVE`].
pub const RESERVE_PER_TOKEN_HIDDEN: u64 = 8;
/// The name of that part of the device budget.
pub const RUNTIME_RESERVE: &str = "runtime reserve (CUDA context, cuBLAS workspace)";
/// The name of the device buffer the fp32 master lands in before its cast (a GPU's part only:
/// the CPU computes on f32 weights and reads the master as it is).
pub const CAST_STAGING: &str = "cast staging (fp32 master weights arriving, one chunk)";
/// Alignment of every unit's slab in the host store (DMA bursts start on a page), and of every
/// region of the disk tier's file and staging buffer (direct I/O moves whole pages).
pub const SLAB_ALIGN: u64 = 4096;
/// Host buffers the disk tier's moments pass through, each one unit's m and v as the file holds
/// them (each page-aligned): one being read ahead, one being updated, one being written behind
/// (the store's own count).
pub const DISK_STAGING_SLOTS: u64 = crate::store::disk::STAGE_SLOTS as u64;
/// The name of that part of the host budget.
pub const DISK_STAGING: &str = "disk tier staging (3 x largest disk unit's m and v, fp32)";

/// The four places bytes can live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TierName {
    Device,
    PinnedHost,
    PageableHost,
    /// A file on a local SSD holding the Adam moments of the units the plan puts there.
    Disk,
}

impl TierName {
    pub fn label(self) -> &'static str {
        match self {
            TierName::Device => "device",
            TierName::PinnedHost => "pinned host",
            TierName::PageableHost => "pageable host",
            TierName::Disk => "disk tier",
        }
    }
}

/// One named buffer (or group of buffers) and its size.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Part {
    pub name: String,
    pub bytes: u64,
}

/// One tier's capacity, use and breakdown. Pinned and pageable host memory share the host's
/// RAM: each one's capacity is what the other leaves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Tier {
    pub tier: TierName,
    pub capacity: u64,
    pub used: u64,
    pub parts: Vec<Part>,
}

impl Tier {
    fn new(tier: TierName, parts: Vec<(String, u64)>) -> Tier {
        let parts: Vec<Part> = parts
            .into_iter()
            .filter(|(_, b)| *b > 0)
            .map(|(name, bytes)| Part { name, bytes })
            .collect();
        let used = parts.iter().map(|p| p.bytes).sum();
        Tier { tier, capacity: 0, used, parts }
    }

    /// Bytes of the part whose name starts with `prefix` (0 if absent).
    pub fn part(&self, prefix: &str) -> u64 {
        self.parts.iter().filter(|p| p.name.starts_with(prefix)).map(|p| p.bytes).sum()
    }
}

/// Memory per tier for one plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Budget {
    pub device: Tier,
    pub pinned_host: Tier,
    pub pageable_host: Tier,
    /// Host RAM available to the job (pinned and pageable together).
    pub host_capacity: u64,
    /// The disk tier where the machine has one (used or not), its capacity the bytes it may
    /// take there.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk: Option<Tier>,
}

impl Budget {
    /// Pinned plus pageable bytes.
    pub fn host_used(&self) -> u64 {
        self.pinned_host.used + self.pageable_host.used
    }

    /// Bytes by which the device overflows (0 if it fits).
    pub fn device_over(&self) -> u64 {
        self.device.used.saturating_sub(self.device.capacity)
    }

    /// Bytes by which host RAM overflows (0 if it fits).
    pub fn host_over(&self) -> u64 {
        self.host_used().saturating_sub(self.host_capacity)
    }

    /// Bytes by which the disk tier overflows (0 if it fits or there is none).
    pub fn disk_over(&self) -> u64 {
        self.disk.as_ref().map_or(0, |d| d.used.saturating_sub(d.capacity))
    }

    /// Bytes the plan keeps on the disk tier.
    pub fn disk_used(&self) -> u64 {
        self.disk.as_ref().map_or(0, |d| d.used)
    }

    pub fn fits(&self) -> bool {
        self.device_over() == 0 && self.host_over() == 0 && self.disk_over() == 0
    }

    /// Device, pinned host, pageable host, and the disk tier where the machine has one.
    pub fn tiers(&self) -> Vec<&Tier> {
        let mut tiers = vec![&self.device, &self.pinned_host, &self.pageable_host];
        tiers.extend(&self.disk);
        tiers
    }
}

/// The choices a budget depends on.
#[derive(Debug, Clone, PartialEq)]
pub struct Layout {
    pub checkpoints: CheckpointTier,
    pub interval: usize,
    pub gradients: GradientTier,
    /// Slots of the host gradient ring, where the tier uses one.
    pub ring_slots: usize,
    pub weights: WeightSource,
    /// Per unit: whether its bf16 weights stay on the device.
    pub resident: Vec<bool>,
    /// Per unit: whether its Adam moments live on the disk tier.
    pub disk: Vec<bool>,
    /// Per unit: whether a decoder layer's activations stay on the device from the forward to
    /// the backward (no recompute).
    pub kept: Vec<bool>,
    /// Per unit: whether a decoder layer's attention output stays on the device from the
    /// forward to the backward (its recompute skips the attention).
    pub kept_attention: Vec<bool>,
}

impl Layout {
    pub fn embedding_resident(&self) -> bool {
        self.resident.first().copied().unwrap_or(false)
    }

    /// Whether unit `u`'s Adam moments live on the disk tier.
    pub fn on_disk(&self, u: usize) -> bool {
        self.disk.get(u).copied().unwrap_or(false)
    }

    /// Units whose Adam moments live on the disk tier.
    pub fn disk_units(&self) -> Vec<usize> {
        (0..self.disk.len()).filter(|&u| self.on_disk(u)).collect()
    }

    /// Checkpointed unit inputs per micro-batch: every K-th layer's input and the head's.
    pub fn checkpoint_count(&self, s: &Sizes) -> u64 {
        s.layers.div_ceil(self.interval.max(1)) as u64 + 1
    }

    /// Largest parameter count a weight slot must hold (0 when nothing streams).
    pub fn slot_params(&self, s: &Sizes) -> u64 {
        let emb = self.embedding_resident();
        (0..s.units.len())
            .filter(|&u| !self.resident.get(u).copied().unwrap_or(false))
            .map(|u| s.visit_params(u, emb))
            .max()
            .unwrap_or(0)
    }
}

/// Device bytes that do not depend on which units are resident.
pub fn device_base(s: &Sizes, l: &Layout) -> Vec<(String, u64)> {
    let g = s.batch.grad_accum as u64;
    let largest = |skip_embedding: bool| {
        s.units
            .iter()
            .enumerate()
            .filter(|(u, _)| !(skip_embedding && *u == 0))
            .map(|(_, x)| x.params)
            .max()
            .unwrap_or(0)
    };
    let mut parts = Vec::new();
    match l.gradients {
        GradientTier::DeviceStore => parts.push((
            "gradient store (fp32, every unit, waits for the global norm)".to_string(),
            s.params * F32,
        )),
        GradientTier::HostStore | GradientTier::HostStoreBf16 | GradientTier::HostRing => {
            if l.gradients == GradientTier::HostStoreBf16 {
                parts.push((
                    "gradient rounding (2 x largest unit, bf16, after the fp32 norm)".to_string(),
                    2 * largest(false) * BF16,
                ));
            }
            // A tied LM head accumulates into the embedding's gradient, which then stays live
            // through the whole backward; the double buffer serves the other units.
            parts.push((
                "gradient accumulators (2 x largest unit, fp32)".to_string(),
                2 * largest(s.tied) * F32,
            ));
            if s.tied {
                parts.push((
                    "tied embedding gradient (fp32, live from the head to the embedding)"
                        .to_string(),
                    s.vocab * s.hidden * F32,
                ));
            }
        }
    }
    parts.push(("layer scratch (one micro-batch)".to_string(), s.layer_scratch));
    let kept = l.kept.iter().filter(|&&k| k).count() as u64;
    if kept > 0 {
        parts.push((
            format!("kept activations ({kept} layers x {g} micro-batches, no recompute)"),
            kept * g * s.kept_layer,
        ));
    }
    let attention = l.kept_attention.iter().filter(|&&k| k).count() as u64;
    if attention > 0 {
        parts.push((
            format!(
                "kept attention outputs ({attention} layers x {g} micro-batches, the recompute \
                 skips the attention)"
            ),
            attention * g * s.kept_attention,
        ));
    }
    parts.push(("head: final norm and chunked cross-entropy".to_string(), s.head_workspace));
    if s.attention_sums > 0 {
        parts.push((
            "attention backward's f32 sums (beyond the head's logits chunk)".to_string(),
            s.attention_sums,
        ));
    }
    parts.push((
        "current unit's activations or their gradients, in and out (2 x G micro-batches, bf16)"
            .to_string(),
        2 * s.activation_set(),
    ));
    match l.checkpoints {
        CheckpointTier::Device => {
            parts.push((
                format!(
                    "checkpoints ({} unit inputs x {g} micro-batches, bf16)",
                    l.checkpoint_count(s)
                ),
                l.checkpoint_count(s) * s.activation_set(),
            ));
            if l.interval > 1 {
                parts.push((
                    format!(
                        "recomputed segment ({} layer inputs x {g} micro-batches)",
                        l.interval - 1
                    ),
                    (l.interval as u64 - 1) * s.activation_set(),
                ));
            }
        }
        CheckpointTier::Host => parts.push((
            "checkpoint prefetch (2 micro-batches, bf16)".to_string(),
            2 * s.activation_one(),
        )),
    }
    parts.push((
        format!("token batches ({g} micro-batches, i32)"),
        s.batch.step_tokens() * TOKEN_ARRAYS * 4 + g * 4,
    ));
    if l.weights == WeightSource::Master {
        let largest = s.units.iter().map(|u| u.params).max().unwrap_or(0);
        parts.push((CAST_STAGING.to_string(), largest.min(CAST_CHUNK as u64) * F32));
    }
    let temporaries = RESERVE_PER_TOKEN_HIDDEN * s.batch.micro_tokens() * s.hidden;
    parts.push((RUNTIME_RESERVE.to_string(), DEVICE_RESERVE + temporaries));
    parts
}

/// Device bytes for the weights: the two streaming slots and the resident units.
pub fn device_weights(s: &Sizes, l: &Layout) -> Vec<(String, u64)> {
    let resident: u64 =
        s.units.iter().zip(&l.resident).filter(|(_, r)| **r).map(|(u, _)| u.params * BF16).sum();
    let count = l.resident.iter().filter(|r| **r).count();
    vec![
        ("weight slots (2 x largest streamed unit, bf16)".to_string(), 2 * l.slot_params(s) * BF16),
        (format!("resident weights ({count} units, bf16)"), resident),
    ]
}

/// Bytes of one unit's m (or v) in the disk tier's file: fp32, rounded up to a page, as
/// direct I/O reads and writes them.
pub fn disk_region(params: u64) -> u64 {
    (params * F32).next_multiple_of(SLAB_ALIGN)
}

/// Bytes of unit `u`'s m and v on the disk tier (0 for a unit in host memory).
pub fn disk_unit_bytes(s: &Sizes, l: &Layout, u: usize) -> u64 {
    if l.on_disk(u) { 2 * disk_region(s.units[u].params) } else { 0 }
}

/// The whole budget of a layout against the machine's capacities (`disk_bytes`: the disk
/// tier's, where the machine has one).
pub fn budget(
    s: &Sizes,
    l: &Layout,
    gpu_bytes: u64,
    host_bytes: u64,
    disk_bytes: Option<u64>,
) -> Budget {
    let mut dev = device_weights(s, l);
    dev.extend(device_base(s, l));
    let mut device = Tier::new(TierName::Device, dev);
    device.capacity = gpu_bytes;

    let p = s.params;
    let units = s.units.len() as u64;
    let largest = s.units.iter().map(|u| u.params).max().unwrap_or(0);
    let g = s.batch.grad_accum as u64;
    let mut pinned = Vec::new();
    match l.weights {
        WeightSource::StreamingCopy => pinned.push(("bf16 streaming copy".to_string(), p * BF16)),
        WeightSource::Master => {
            pinned.push(("fp32 master weights (the weights stream from them)".to_string(), p * F32))
        }
    }
    match l.gradients {
        GradientTier::HostStore => {
            pinned.push(("gradient store (fp32, waits for the global norm)".to_string(), p * F32))
        }
        GradientTier::HostStoreBf16 => pinned.push((
            "gradient store (bf16, waits for the global norm taken in fp32)".to_string(),
            p * BF16,
        )),
        GradientTier::DeviceStore | GradientTier::HostRing => pinned.push((
            format!("gradient landing ring ({} x largest unit, fp32)", l.ring_slots),
            l.ring_slots as u64 * largest * F32,
        )),
    }
    if l.checkpoints == CheckpointTier::Host {
        pinned.push((
            format!(
                "checkpoints ({} unit inputs x {g} micro-batches, bf16)",
                l.checkpoint_count(s)
            ),
            l.checkpoint_count(s) * s.activation_set(),
        ));
    }
    pinned.push((
        format!("token staging ({g} micro-batches, i32)"),
        s.batch.step_tokens() * TOKEN_ARRAYS * 4 + g * 4,
    ));
    pinned.push(("slab alignment (4 KiB per unit)".to_string(), units * SLAB_ALIGN));
    let mut pinned = Tier::new(TierName::PinnedHost, pinned);

    // The moments of units on the disk tier are not in host memory: only those of the others,
    // and the staging their updates pass through.
    let disk_units = l.disk_units();
    let host_units = units - disk_units.len() as u64;
    let host_params: u64 =
        (0..s.units.len()).filter(|&u| !l.on_disk(u)).map(|u| s.units[u].params).sum();
    let moments = |which: &str| {
        if disk_units.is_empty() {
            format!("Adam {which} (fp32)")
        } else {
            format!("Adam {which} (fp32, {host_units} of {units} units; the rest on the disk tier)")
        }
    };
    let mut pageable = Vec::new();
    let masters = u64::from(l.weights == WeightSource::StreamingCopy);
    if l.weights == WeightSource::StreamingCopy {
        pageable.push(("fp32 master weights".to_string(), p * F32));
    }
    pageable.extend([
        (moments("first moment m"), host_params * F32),
        (moments("second moment v"), host_params * F32),
        (
            "slab alignment (4 KiB per unit per array)".to_string(),
            (masters * units + 2 * host_units) * SLAB_ALIGN,
        ),
    ]);
    let largest_disk = disk_units.iter().map(|&u| s.units[u].params).max().unwrap_or(0);
    if !disk_units.is_empty() {
        pageable
            .push((DISK_STAGING.to_string(), DISK_STAGING_SLOTS * 2 * disk_region(largest_disk)));
    }
    let mut pageable = Tier::new(TierName::PageableHost, pageable);
    pinned.capacity = host_bytes.saturating_sub(pageable.used);
    pageable.capacity = host_bytes.saturating_sub(pinned.used);
    let disk = disk_bytes.map(|capacity| {
        let on_disk: u64 = (0..s.units.len()).map(|u| disk_unit_bytes(s, l, u)).sum();
        let mut tier = Tier::new(
            TierName::Disk,
            vec![(format!("Adam moments m and v (fp32, {} units)", disk_units.len()), on_disk)],
        );
        tier.capacity = capacity;
        tier
    });
    Budget { device, pinned_host: pinned, pageable_host: pageable, host_capacity: host_bytes, disk }
}
