//! The machine as the planner sees it: memory per tier and the rates of the resources a step
//! keeps busy. The default rates are the H200 test machine's, measured on 2026-11-29 (the table
//! in shared/GPU_MACHINE.md); each field says where its figure comes from.

use serde::Serialize;

use crate::error::{Error, Result};
pub use crate::placement::{DiskSpace, MemorySource};

/// Sustained rates of the four resources a training step uses.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct MachineRates {
    /// Host-to-device bytes/s over PCIe from pinned memory while the other direction is busy
    /// too. Measured: 50.8 GB/s each way with both directions at once (55.5 one way alone).
    pub pcie_h2d: f64,
    /// Device-to-host bytes/s, concurrently with `pcie_h2d`. Measured: 50.8 GB/s each way.
    pub pcie_d2h: f64,
    /// Effective bf16 GEMM FLOP/s on a decoder layer's shapes. Measured: 684-772 TFLOPS at
    /// typical layer shapes, 791 at 8192^3 (torch, cuBLAS); 700 leaves room for small GEMMs.
    pub gemm_flops: f64,
    /// Peak forward attention FLOP/s of Sluice's tensor-core kernels on sm_90 (the Hopper
    /// kernels, the default there), reached at long rows; at sequence length `s` they run at
    /// `attention_forward_flops x s / (s + attention_forward_half_seq)`. The mma.sync kernels
    /// measured in training (`sluice bench train --profile`, H200, 2026-12-04, Qwen2.5-7B,
    /// head_dim 128) 162.6 TFLOPS at seq 1024 and 244.2 at seq 32768 (a peak of 248e12 with
    /// half at 539 tokens); the Hopper kernel runs those rows 1.377 and 1.657 times as fast
    /// (`sluice bench attention`, H100, 2026-12-06; the two GPUs share the SM count and clock
    /// attention is bound by), which this curve fits: 223.8 and 404.3 TFLOPS.
    pub attention_forward_flops: f64,
    /// The sequence length at which the forward runs at half its peak.
    pub attention_forward_half_seq: f64,
    /// The same for the backward (its FLOPs counted as 2.5 forwards), which runs slower than
    /// the forward: the split mma.sync kernels measured 114.7 TFLOPS at seq 1024 and 182.2 at
    /// seq 32768 (same runs; 186e12, half at 634), the Hopper ones 1.426 and 1.619 times as
    /// fast (same bench), which this curve fits: 163.8 and 295.5 TFLOPS. A recompute that a kept
    /// attention output spares is a forward.
    pub attention_backward_flops: f64,
    pub attention_backward_half_seq: f64,
    /// Attention FLOP/s of the scalar kernels, which soft-capped attention (Gemma 2) runs on.
    /// Measured: Gemma-2-9B at 64 x 1024 tokens took 36.9 s a step on the H200 (2026-12-03),
    /// about 29.6 s of it attention's 1.0e14 FLOPs (forward, recompute and backward): 3.5 TFLOPS.
    pub scalar_attention_flops: f64,
    /// FLOP/s of the chunked LM head (its three GEMMs, `6 p N`, with the softmax, loss and
    /// logits' gradient between them). Measured (profile, H200, 2026-12-04, the fused forward
    /// and backward, chunks of 2^28 logits, `placement::LOSS_CHUNK_LOGITS`): 544 TFLOPS at
    /// hidden 3584, 458 at hidden 1536.
    pub head_flops: f64,
    /// Effective bytes/s of a layer's elementwise kernels (norms, RoPE, biases, the gated
    /// activation, residual adds) over the bytes they must move (`Sizes::elementwise_*`).
    /// Measured (profile, H200, 2026-12-03): 2.75 TB/s at Qwen2.5-7B and 2.69 at 1.5B with the
    /// vectorized kernels (1.16 and 1.21 before them).
    pub elementwise_bytes: f64,
    /// Parameters/s of the CPU AdamW on all cores. Measured: torch's fused CPU AdamW 4.67
    /// Gparam/s on the 16 cores; 5e9 is the target of Sluice's fused update.
    pub adam_params: f64,
    /// Host memory copy bytes/s (read + write), 16 threads. Measured: 65.7 GB/s (torch). The
    /// current schedule makes no host-to-host copies (every transfer is a DMA from or to pinned
    /// memory, and the gradient norm is summed on the device), so no prediction uses it yet; it
    /// prices host-side passes when one is added.
    pub host_memcpy: f64,
    /// Layer parameters/s a streamed evaluation uploads (`generate::Streamed`: the host's
    /// fp32 weights converted to bf16 into pinned staging and copied to the device's slot,
    /// synchronously, once per forward). Measured (`sluice eval --preset qwen2.5-7b --metric
    /// exact_match --records 64 --batch 64 --max-new-tokens 64`, H100, 2026-12-07): 54.59 s
    /// streamed against 7.31 s resident over the same 65 forwards, 0.727 s of uploads a
    /// forward for 6.53e9 layer parameters.
    pub stream_params: f64,
    /// Seconds a batched forward spends per sequence and layer beside its GEMMs: each
    /// sequence's attention and its small kernels are launched on their own. Measured (the
    /// same resident run): 7.31 s for 65 forwards of 64 sequences and 28 layers, of which the
    /// GEMMs take 0.18 s: 61 us.
    pub sequence_layer_s: f64,
    /// Host seconds per logit of a row scored by likelihood: its download and the f64
    /// log-softmax over the vocabulary, on one thread. Measured (the same command with
    /// `--metric perplexity`, resident): 5.80 s for 2 forwards whose GEMMs take 0.29 s, over
    /// 2,401 rows of 152,064 logits: 15 ns.
    pub scored_logit_s: f64,
}

impl Default for MachineRates {
    fn default() -> Self {
        MachineRates {
            pcie_h2d: 50e9,
            pcie_d2h: 50e9,
            gemm_flops: 700e12,
            attention_forward_flops: 415e12,
            attention_forward_half_seq: 876.0,
            attention_backward_flops: 303e12,
            attention_backward_half_seq: 872.0,
            scalar_attention_flops: 3.5e12,
            head_flops: 500e12,
            elementwise_bytes: 2.7e12,
            adam_params: 5e9,
            host_memcpy: 60e9,
            stream_params: 9.0e9,
            sequence_layer_s: 61e-6,
            scored_logit_s: 15e-9,
        }
    }
}

impl MachineRates {
    /// The CPU backend's rough figures: its "device" is host memory (copies are memcpy) and its
    /// GEMMs run on the cores (about 20 GFLOP/s sustained through matrixmultiply on a small
    /// machine), so a CPU job's predicted step time is of the right order, not a GPU's.
    pub fn cpu() -> MachineRates {
        MachineRates {
            pcie_h2d: 10e9,
            pcie_d2h: 10e9,
            gemm_flops: 2e10,
            attention_forward_flops: 1e10,
            attention_forward_half_seq: 0.0,
            attention_backward_flops: 1e10,
            attention_backward_half_seq: 0.0,
            scalar_attention_flops: 1e10,
            head_flops: 2e10,
            elementwise_bytes: 5e9,
            adam_params: 5e8,
            host_memcpy: 10e9,
            stream_params: 2.5e9,
            sequence_layer_s: 20e-6,
            scored_logit_s: 15e-9,
        }
    }

    /// Forward attention FLOP/s of the tensor-core kernels on rows of `seq_len` tokens.
    pub fn attention_forward_rate(&self, seq_len: usize) -> f64 {
        saturating(self.attention_forward_flops, self.attention_forward_half_seq, seq_len)
    }

    /// Backward attention FLOP/s (counted as 2.5 forwards) on rows of `seq_len` tokens.
    pub fn attention_backward_rate(&self, seq_len: usize) -> f64 {
        saturating(self.attention_backward_flops, self.attention_backward_half_seq, seq_len)
    }

    /// Rejects a rate that is not finite and positive, naming it.
    pub fn validate(&self) -> Result<()> {
        let fields = [
            ("pcie_h2d", self.pcie_h2d),
            ("pcie_d2h", self.pcie_d2h),
            ("gemm_flops", self.gemm_flops),
            ("attention_forward_flops", self.attention_forward_flops),
            ("attention_backward_flops", self.attention_backward_flops),
            ("scalar_attention_flops", self.scalar_attention_flops),
            ("head_flops", self.head_flops),
            ("elementwise_bytes", self.elementwise_bytes),
            ("adam_params", self.adam_params),
            ("host_memcpy", self.host_memcpy),
            ("stream_params", self.stream_params),
            ("sequence_layer_s", self.sequence_layer_s),
            ("scored_logit_s", self.scored_logit_s),
        ];
        for (name, seq) in [
            ("attention_forward_half_seq", self.attention_forward_half_seq),
            ("attention_backward_half_seq", self.attention_backward_half_seq),
        ] {
            if !(seq.is_finite() && seq >= 0.0) {
                return Err(Error::invalid(format!("machine rate {name} must be >= 0, got {seq}")));
            }
        }
        for (name, rate) in fields {
            if !(rate.is_finite() && rate > 0.0) {
                return Err(Error::invalid(format!("machine rate {name} must be > 0, got {rate}")));
            }
        }
        Ok(())
    }
}

/// `peak x s / (s + half)`: a rate that grows with the row length `s` and reaches half its peak
/// at `half` tokens.
fn saturating(peak: f64, half: f64, seq_len: usize) -> f64 {
    let s = seq_len.max(1) as f64;
    peak * s / (s + half.max(0.0))
}

/// GPU memory assumed when no GPU can be read: the H200's 143771 MiB less the CUDA context and
/// driver reservations, rounded down to 139 GiB.
pub const H200_GPU_BYTES: u64 = 139 << 30;

/// Which GPU's memory a plan is for, when its capacity is not given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuQuery {
    /// A job on this GPU: its memory must be readable, or the plan is an error.
    Ordinal(usize),
    /// No device named (`sluice plan`): GPU 0 if the driver answers, else an H200 is assumed,
    /// so a plan can be made on a machine without the GPU it is for.
    FirstOrH200,
    /// The CPU backend: no GPU; host memory holds everything.
    HostOnly,
}

/// Memory capacities of the two places a job can use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MachineMemory {
    /// Device memory the job may use, bytes.
    pub gpu_bytes: u64,
    pub gpu_source: MemorySource,
    /// The GPU's whole memory when it was read (the plan uses the free part, `gpu_bytes`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_total: Option<u64>,
    /// Host memory the job may use (pinned and pageable together), bytes.
    pub host_bytes: u64,
    pub host_source: MemorySource,
    /// MemTotal when the host was read (the plan uses MemAvailable, `host_bytes`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_total: Option<u64>,
    /// A local disk the planner may place Adam moments on where host memory runs out (the
    /// disk tier); `None`: no disk tier.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk: Option<DiskSpace>,
}

impl MachineMemory {
    /// Both capacities as given (flags, tests).
    pub fn given(gpu_bytes: u64, host_bytes: u64) -> MachineMemory {
        MachineMemory {
            gpu_bytes,
            gpu_source: MemorySource::Given,
            gpu_total: None,
            host_bytes,
            host_source: MemorySource::Given,
            host_total: None,
            disk: None,
        }
    }

    /// Fills what the caller did not give from the machine itself.
    ///
    /// Host: MemAvailable from `/proc/meminfo`, not MemTotal. MemTotal includes what the kernel,
    /// other processes and unreclaimable caches already hold; a plan against it passes jobs that
    /// then swap or are killed. MemAvailable is the kernel's estimate of what can be allocated
    /// without swapping (free memory plus reclaimable cache), read before the job allocates.
    ///
    /// GPU: the driver's free memory for the same reason (another process may hold part of the
    /// card), read through `cuMemGetInfo` inside the primary context the job will use.
    pub fn detect(
        gpu: GpuQuery,
        gpu_bytes: Option<u64>,
        host_bytes: Option<u64>,
    ) -> Result<MachineMemory> {
        let (host_bytes, host_source, host_total) = match host_bytes {
            Some(b) => (b, MemorySource::Given, None),
            None => {
                let (available, total) = host_memory()?;
                (available, MemorySource::Measured, Some(total))
            }
        };
        let (gpu_bytes, gpu_source, gpu_total) = match (gpu, gpu_bytes) {
            (GpuQuery::HostOnly, Some(_)) => {
                return Err(Error::invalid("the CPU backend has no GPU memory to give"));
            }
            (GpuQuery::HostOnly, None) => (host_bytes, MemorySource::SharedWithHost, None),
            (_, Some(b)) => (b, MemorySource::Given, None),
            (GpuQuery::Ordinal(n), None) => {
                let (free, total) = crate::backend::cuda::device_memory(n)?;
                (free, MemorySource::Measured, Some(total))
            }
            (GpuQuery::FirstOrH200, None) => match crate::backend::cuda::device_memory(0) {
                Ok((free, total)) => (free, MemorySource::Measured, Some(total)),
                Err(_) => (H200_GPU_BYTES, MemorySource::AssumedH200, None),
            },
        };
        Ok(MachineMemory {
            gpu_bytes,
            gpu_source,
            gpu_total,
            host_bytes,
            host_source,
            host_total,
            disk: None,
        })
    }

    /// Whether the device's buffers come out of host memory (the CPU backend).
    pub fn shared(&self) -> bool {
        self.gpu_source == MemorySource::SharedWithHost
    }
}

/// (MemAvailable, MemTotal) from `/proc/meminfo`, in bytes.
pub fn host_memory() -> Result<(u64, u64)> {
    let path = "/proc/meminfo";
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let field = |name| {
        meminfo_kib(&text, name).ok_or_else(|| {
            Error::invalid(format!("{path}: no {name} line in kB; give the host memory instead"))
        })
    };
    Ok((field("MemAvailable")?, field("MemTotal")?))
}

/// A `NAME: <n> kB` line of `/proc/meminfo`, in bytes.
fn meminfo_kib(meminfo: &str, name: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.split(':').next() == Some(name))?;
    let mut words = line.split_whitespace().skip(1);
    let kib: u64 = words.next()?.parse().ok()?;
    (words.next()? == "kB").then_some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_meminfo_fields_in_bytes() {
        let text = "MemTotal:       24604160 kB\nMemFree:  100 kB\nMemAvailable:   21000000 kB\n";
        assert_eq!(meminfo_kib(text, "MemAvailable"), Some(21_000_000 * 1024));
        assert_eq!(meminfo_kib(text, "MemTotal"), Some(24_604_160 * 1024));
        assert_eq!(meminfo_kib("MemTotal: 5 kB\n", "MemAvailable"), None);
        assert_eq!(meminfo_kib("MemAvailable: lots kB\n", "MemAvailable"), None);
        assert_eq!(meminfo_kib("MemAvailable: 5 MB\n", "MemAvailable"), None);
    }

    #[test]
    fn detect_keeps_given_values_and_says_where_the_rest_came_from() {
        let m = MachineMemory::detect(GpuQuery::Ordinal(0), Some(5), Some(7)).expect("given");
        assert_eq!(m, MachineMemory::given(5, 7));
        // The CPU backend: the device is host memory, and no GPU capacity can be given.
        let m = MachineMemory::detect(GpuQuery::HostOnly, None, Some(7)).expect("host given");
        assert_eq!((m.gpu_bytes, m.gpu_source), (7, MemorySource::SharedWithHost));
        assert!(m.shared());
        let err = MachineMemory::detect(GpuQuery::HostOnly, Some(5), Some(7)).expect_err("gpu");
        assert!(err.to_string().contains("no GPU memory"), "{err}");
        // Host memory read from this machine: MemAvailable, with MemTotal beside it.
        let m = MachineMemory::detect(GpuQuery::HostOnly, None, None).expect("meminfo");
        assert_eq!(m.host_source, MemorySource::Measured);
        assert!(m.host_total.is_some_and(|t| t >= m.host_bytes && m.host_bytes > 0), "{m:?}");
    }

    #[test]
    fn without_a_gpu_sluice_plan_assumes_an_h200_and_a_job_on_one_is_an_error() {
        // Only meaningful where no NVIDIA driver answers (CI and the development machines).
        if crate::backend::cuda::device_memory(0).is_ok() {
            return;
        }
        let m = MachineMemory::detect(GpuQuery::FirstOrH200, None, Some(7)).expect("assumed");
        assert_eq!((m.gpu_bytes, m.gpu_source), (H200_GPU_BYTES, MemorySource::AssumedH200));
        let err = MachineMemory::detect(GpuQuery::Ordinal(0), None, Some(7)).expect_err("no GPU");
        assert!(err.to_string().contains("NVIDIA") || err.to_string().contains("GPU"), "{err}");
    }

    #[test]
    fn bad_rates_are_rejected_by_name() {
        let bad = MachineRates { adam_params: 0.0, ..MachineRates::default() };
        let err = bad.validate().expect_err("zero rate");
        assert!(err.to_string().contains("adam_params"), "{err}");
        MachineRates::default().validate().expect("defaults are valid");
    }
}
