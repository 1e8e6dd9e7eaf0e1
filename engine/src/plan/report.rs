//! The plan as text for a terminal: placement (where the Adam moments live among it), the
//! budget of each tier part by part, the step time and its bottleneck, or the refusal and what
//! would fit.

use std::fmt;

use super::sizes::Sizes;
use super::{
    Bottleneck, Budget, CheckpointTier, GradientTier, MachineMemory, MemorySource, OptimizerMode,
    Plan, Refusal, Suggestion, WeightSource,
};

/// Bytes as GiB with two decimals ("13.27 GiB"); small sizes in MiB.
pub fn gib(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= (1u64 << 30) as f64 {
        format!("{:.2} GiB", b / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", b / (1u64 << 20) as f64)
    }
}

/// Resident units as ranges: "embedding, layers 0-27, head".
pub(super) fn unit_ranges(s: &Sizes, units: &[usize]) -> String {
    let head = s.head();
    let mut parts = Vec::new();
    if units.contains(&0) {
        parts.push("embedding".to_string());
    }
    let layers: Vec<usize> = units.iter().filter(|&&u| u > 0 && u < head).map(|u| u - 1).collect();
    let mut i = 0;
    while i < layers.len() {
        let mut j = i;
        while j + 1 < layers.len() && layers[j + 1] == layers[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            format!("layer {}", layers[i])
        } else {
            format!("layers {}-{}", layers[i], layers[j])
        });
        i = j + 1;
    }
    if units.contains(&head) {
        parts.push("head".to_string());
    }
    if parts.is_empty() { "none".to_string() } else { parts.join(", ") }
}

fn source(s: &MemorySource) -> &'static str {
    match s {
        MemorySource::Given => "given",
        MemorySource::Measured => "read from this machine",
        MemorySource::AssumedH200 => "no GPU could be read: assuming an H200",
        MemorySource::SharedWithHost => "the CPU backend: host memory",
    }
}

/// "139.20 GiB (read from this machine: free of 139.80 GiB)".
fn capacity(bytes: u64, s: &MemorySource, total: Option<u64>, what: &str) -> String {
    match total {
        Some(t) => format!("{} ({}: {what} of {})", gib(bytes), source(s), gib(t)),
        None => format!("{} ({})", gib(bytes), source(s)),
    }
}

/// Bytes/s as GB/s with one decimal.
fn gb_s(bytes_per_s: u64) -> String {
    format!("{:.1}", bytes_per_s as f64 / 1e9)
}

fn write_machine(f: &mut fmt::Formatter<'_>, mem: &MachineMemory) -> fmt::Result {
    let host = capacity(mem.host_bytes, &mem.host_source, mem.host_total, "MemAvailable");
    if mem.shared() {
        writeln!(f, "machine: host {host}, which also holds what a GPU would")?;
    } else {
        let gpu = capacity(mem.gpu_bytes, &mem.gpu_source, mem.gpu_total, "free");
        writeln!(f, "machine: GPU {gpu}, host {host}")?;
    }
    if let Some(d) = &mem.disk {
        writeln!(
            f,
            "  disk tier at {}: {} ({}), reads {} GB/s, writes {} GB/s",
            d.dir.display(),
            gib(d.bytes),
            source(&d.source),
            gb_s(d.read_bytes_per_s),
            gb_s(d.write_bytes_per_s)
        )?;
    }
    Ok(())
}

impl Plan {
    /// Where the Adam moments live, in a sentence: "Adam moments of layers 12-27 live on the
    /// disk tier at /mnt/nvme/sluice (48.00 GiB, read and written at 2.1/1.9 GB/s each step:
    /// 24.3 s of disk time per step); host memory is 20.31 GiB short without it." `None` when
    /// every unit's are in host memory.
    pub fn disk_text(&self) -> Option<String> {
        let p = &self.placement;
        let d = self.memory.disk.as_ref().filter(|_| !p.disk_units.is_empty())?;
        let reason =
            if p.disk_reason.is_empty() { String::new() } else { format!("; {}", p.disk_reason) };
        Some(format!(
            "Adam moments of {} live on the disk tier at {} ({}, read and written at {}/{} GB/s \
             each step: {:.1} s of disk time per step){reason}.",
            p.disk_summary,
            d.dir.display(),
            gib(self.budget.disk_used()),
            gb_s(d.read_bytes_per_s),
            gb_s(d.write_bytes_per_s),
            self.time.disk_s
        ))
    }
}

/// Each tier part by part, then the host's total: where the device is host memory (the CPU
/// backend), that total counts the device's buffers too, as the web form's one host bar does.
fn write_budget(f: &mut fmt::Formatter<'_>, b: &Budget, shared: bool) -> fmt::Result {
    for tier in b.tiers() {
        writeln!(
            f,
            "  {:<14} {:>11} used of {:>11}",
            tier.tier.label(),
            gib(tier.used),
            gib(tier.capacity)
        )?;
        for p in &tier.parts {
            writeln!(f, "    {:>11}  {}", gib(p.bytes), p.name)?;
        }
    }
    let host = if shared { b.device.used + b.host_used() } else { b.host_used() };
    writeln!(f, "  host total     {:>11} used of {:>11}", gib(host), gib(b.host_capacity))
}

impl super::EvalPlan {
    /// Seconds of all the run's evaluations, when their number is known.
    pub fn total_s(&self) -> Option<f64> {
        self.evaluations.map(|n| n as f64 * self.each.seconds)
    }

    /// The evaluation's cost in a sentence.
    pub fn text(&self) -> String {
        let e = &self.each;
        let answers = match self.new_tokens {
            0 => String::from("scored by likelihood"),
            n => format!("answers up to {n} tokens"),
        };
        let over = match (self.evaluations, self.total_s()) {
            (Some(n), Some(total)) => format!("; {n} evaluations, {total:.0} s over the run"),
            _ => String::new(),
        };
        let reserve = match self.device_reserve {
            0 => String::new(),
            bytes => format!("; {} of the device kept for it", gib(bytes)),
        };
        format!(
            "task evaluation: at most {:.1} s each ({} records, {} at a time, prompts up to {} \
             tokens, {answers}; {} forwards, the layers streamed from host memory){over}{reserve}",
            e.seconds, self.records, self.sequences, self.prompt_tokens, e.forwards
        )
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = &self.model;
        let b = &self.batch;
        writeln!(
            f,
            "model: {} family, {:.2}B parameters, {} layers, hidden {}, vocab {}",
            m.family,
            m.params as f64 / 1e9,
            m.layers,
            m.hidden,
            m.vocab
        )?;
        writeln!(
            f,
            "batch: {} micro-batches x {} rows x {} tokens = {} tokens per step; clipping {}",
            b.grad_accum,
            b.micro_batch,
            b.seq_len,
            self.tokens_per_step,
            if self.clipping { "on" } else { "off" }
        )?;
        write_machine(f, &self.memory)?;
        let p = &self.placement;
        writeln!(f, "placement:")?;
        writeln!(
            f,
            "  resident units: {} ({} of {}; {} stream)",
            p.resident_summary,
            p.resident_units.len(),
            m.units,
            p.streamed_units
        )?;
        writeln!(
            f,
            "  checkpoints: {}, every {} layer(s)",
            match p.checkpoints {
                CheckpointTier::Device => "on the device",
                CheckpointTier::Host => "in pinned host memory",
            },
            p.checkpoint_interval
        )?;
        if !p.kept_layers.is_empty() {
            writeln!(
                f,
                "  kept activations: {} of {} layers keep their activations from the forward to \
                 the backward (no recompute) in the device's spare memory",
                p.kept_layers.len(),
                m.layers
            )?;
        }
        if !p.kept_attention_layers.is_empty() {
            writeln!(
                f,
                "  kept attention outputs: {} of {} layers keep their attention's output from \
                 the forward, so their recompute skips the attention",
                p.kept_attention_layers.len(),
                m.layers
            )?;
        }
        let reason = match p.gradients_reason.as_str() {
            "" => String::new(),
            r => format!(" ({r})"),
        };
        writeln!(
            f,
            "  gradients: {}{reason}; optimizer {}",
            match p.gradients {
                GradientTier::DeviceStore => "wait for the norm on the device",
                GradientTier::HostStore => "wait for the norm in the host store",
                GradientTier::HostStoreBf16 => {
                    "wait for the norm in the host store in bf16 (the norm itself in fp32 on the \
                     device, so clipping is exact; AdamW sees bf16 gradients)"
                }
                GradientTier::HostRing => "land in a host ring",
            },
            match p.optimizer {
                OptimizerMode::AfterNorm => "after the norm, overlapped with the next forward",
                OptimizerMode::AsGradientsLand => "as gradients land, overlapped with the backward",
            }
        )?;
        writeln!(
            f,
            "  weights: stream from {} ({})",
            match p.weights {
                WeightSource::Master if self.memory.shared() => "the fp32 master",
                WeightSource::Master => "the fp32 master, cast to bf16 on the device",
                WeightSource::StreamingCopy => "a bf16 copy in pinned host memory",
            },
            p.weights_reason
        )?;
        match self.disk_text() {
            Some(text) => writeln!(f, "  moments: {text}")?,
            None => writeln!(f, "  moments: Adam m and v in host memory")?,
        }
        if let Some(par) = &self.parallel {
            writeln!(
                f,
                "GPUs: {} sharing each step ({} micro-batches each); PCIe {:.1} GB/s each way per \
                 GPU (host memory bandwidth shared); gradient all-reduce {:.3} s per step",
                par.gpus,
                par.micro_batches_per_gpu,
                par.link_bytes_per_s / 1e9,
                par.allreduce_s
            )?;
            match (par.one_gpu_step_s, par.speedup) {
                (Some(one), Some(x)) => {
                    writeln!(f, "  speed-up over one GPU: {x:.2}x (one GPU: {one:.3} s per step)")?
                }
                _ => writeln!(f, "  the same batch does not fit one GPU")?,
            }
        }
        if let Some(e) = &self.eval {
            writeln!(f, "{}", e.text())?;
        }
        let shared = if self.parallel.is_some() { " (device: per GPU; host: shared)" } else { "" };
        writeln!(f, "memory{shared}:")?;
        write_budget(f, &self.budget, self.memory.shared())?;
        let t = &self.time;
        writeln!(
            f,
            "step: {:.3} s predicted, {:.0} tokens/s, {:.0} TFLOPS by 6 x params x tokens",
            t.total_s, t.tokens_per_s, t.model_tflops
        )?;
        writeln!(
            f,
            "  GPU compute   {:>8.3} s  (GEMM {:.3} s incl. recompute, LM head {:.3} s, attention \
             {:.3} s, elementwise {:.3} s; idle {:.3} s)",
            t.compute_s, t.gemm_s, t.head_s, t.attention_s, t.elementwise_s, t.gpu_idle_s
        )?;
        writeln!(
            f,
            "  PCIe h2d      {:>8.3} s  ({}); d2h {:.3} s ({})",
            t.h2d_s,
            gib(t.h2d_bytes),
            t.d2h_s,
            gib(t.d2h_bytes)
        )?;
        writeln!(
            f,
            "  CPU AdamW     {:>8.3} s  ({:.3} s hidden behind GPU work, {:.3} s exposed)",
            t.adam_s, t.adam_hidden_s, t.adam_exposed_s
        )?;
        if t.disk_bytes > 0 {
            writeln!(
                f,
                "  disk tier     {:>8.3} s  ({} read and written; AdamW waits on it)",
                t.disk_s,
                gib(t.disk_bytes)
            )?;
        }
        write!(
            f,
            "  bottleneck: {}",
            match t.bottleneck {
                Bottleneck::Pcie => "PCIe",
                Bottleneck::GpuCompute => "GPU compute",
                Bottleneck::CpuAdam => "CPU AdamW",
                Bottleneck::Disk => "the disk tier",
            }
        )
    }
}

impl fmt::Display for Suggestion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Suggestion::MicroBatch(m) => write!(f, "--micro-batch {m}"),
            Suggestion::GradAccum(g) => write!(f, "--grad-accum {g}"),
            Suggestion::HostMemory(b) => write!(f, "{} of host RAM", gib(*b)),
            Suggestion::GpuMemory(b) => write!(f, "{} of GPU memory", gib(*b)),
            Suggestion::DiskSpace(b) => write!(f, "{} on the disk tier", gib(*b)),
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.reason)?;
        if !self.fits.is_empty() {
            let fits: Vec<String> = self.fits.iter().map(|s| s.to_string()).collect();
            write!(f, "; would fit with {}", fits.join(", or "))?;
        }
        Ok(())
    }
}

impl Refusal {
    /// The refusal with the closest placement's budget, for a terminal.
    pub fn details(&self) -> String {
        struct Details<'a>(&'a Refusal);
        impl fmt::Display for Details<'_> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                writeln!(f, "does not fit: {}", self.0)?;
                write_machine(f, &self.0.memory)?;
                writeln!(f, "memory of the closest placement:")?;
                write_budget(f, &self.0.budget, self.0.memory.shared())
            }
        }
        Details(self).to_string()
    }
}
