//! The machine as the planner sees it: memory per tier and the rates of the resources a step
//! keeps busy. The default rates are the H200 test machine's, measured on 2026-11-29 (the table
//! in shared/GPU_MACHINE.md); each field says where its figure comes from.

use serde::Serialize;

use crate::error::{Error, Result};

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
    /// Attention FLOP/s (fused forward and backward, causal, head_dim 128). Measured with torch
    /// SDPA: ~490 TFLOPS at seq 4096 to ~580 at 16384; 450 for shorter sequences and our own
    /// kernel.
    pub attention_flops: f64,
    /// Parameters/s of the CPU AdamW on all cores. Measured: torch's fused CPU AdamW 4.67
    /// Gparam/s on the 16 cores; 5e9 is the target of Sluice's fused update.
    pub adam_params: f64,
    /// Host memory copy bytes/s (read + write), 16 threads. Measured: 65.7 GB/s (torch). The
    /// current schedule makes no host-to-host copies (every transfer is a DMA from or to pinned
    /// memory, and the gradient norm is summed on the device), so no prediction uses it yet; it
    /// prices host-side passes when one is added.
    pub host_memcpy: f64,
}

impl Default for MachineRates {
    fn default() -> Self {
        MachineRates {
            pcie_h2d: 50e9,
            pcie_d2h: 50e9,
            gemm_flops: 700e12,
            attention_flops: 450e12,
            adam_params: 5e9,
            host_memcpy: 60e9,
        }
    }
}

impl MachineRates {
    /// Rejects a rate that is not finite and positive, naming it.
    pub fn validate(&self) -> Result<()> {
        let fields = [
            ("pcie_h2d", self.pcie_h2d),
            ("pcie_d2h", self.pcie_d2h),
            ("gemm_flops", self.gemm_flops),
            ("attention_flops", self.attention_flops),
            ("adam_params", self.adam_params),
            ("host_memcpy", self.host_memcpy),
        ];
        for (name, rate) in fields {
            if !(rate.is_finite() && rate > 0.0) {
                return Err(Error::invalid(format!("machine rate {name} must be > 0, got {rate}")));
            }
        }
        Ok(())
    }
}

/// GPU memory assumed when no GPU can be read: the H200's 143771 MiB less the CUDA context and
/// driver reservations, rounded down to 139 GiB.
pub const H200_GPU_BYTES: u64 = 139 << 30;

/// Where a memory capacity came from, so the output can say when it is an assumption.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MemorySource {
    /// Given by the caller (a command-line flag or the web form).
    Given,
    /// Read from the machine (`/proc/meminfo` MemAvailable for the host, the driver for a GPU).
    Measured,
    /// No GPU could be read: the H200 figure is assumed.
    AssumedH200,
}

/// Memory capacities of the two places a job can use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MachineMemory {
    /// Device memory the job may use, bytes.
    pub gpu_bytes: u64,
    pub gpu_source: MemorySource,
    /// Host memory the job may use (pinned and pageable together), bytes.
    pub host_bytes: u64,
    pub host_source: MemorySource,
}

impl MachineMemory {
    /// Fills what the caller did not give: host memory from `/proc/meminfo` (MemAvailable), GPU
    /// memory from the driver when a GPU backend can be asked, else the H200 assumption.
    pub fn detect(gpu_bytes: Option<u64>, host_bytes: Option<u64>) -> Result<MachineMemory> {
        let (host_bytes, host_source) = match host_bytes {
            Some(b) => (b, MemorySource::Given),
            None => (host_available()?, MemorySource::Measured),
        };
        // No GPU backend exists yet to ask the driver; the CUDA backend will fill this in.
        let (gpu_bytes, gpu_source) = match gpu_bytes {
            Some(b) => (b, MemorySource::Given),
            None => (H200_GPU_BYTES, MemorySource::AssumedH200),
        };
        Ok(MachineMemory { gpu_bytes, gpu_source, host_bytes, host_source })
    }
}

/// MemAvailable from `/proc/meminfo`, in bytes.
pub fn host_available() -> Result<u64> {
    let path = "/proc/meminfo";
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    parse_mem_available(&text).ok_or_else(|| {
        Error::invalid(format!("{path}: no MemAvailable line in kB; give the host memory instead"))
    })
}

fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut words = line.split_whitespace().skip(1);
    let kib: u64 = words.next()?.parse().ok()?;
    (words.next()? == "kB").then_some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_mem_available_in_bytes() {
        let text = "MemTotal:       24604160 kB\nMemFree:  100 kB\nMemAvailable:   21000000 kB\n";
        assert_eq!(parse_mem_available(text), Some(21_000_000 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 5 kB\n"), None);
        assert_eq!(parse_mem_available("MemAvailable: lots kB\n"), None);
        assert_eq!(parse_mem_available("MemAvailable: 5 MB\n"), None);
    }

    #[test]
    fn detect_keeps_given_values_and_says_when_it_assumes() {
        let m = MachineMemory::detect(None, Some(7)).expect("host given");
        assert_eq!((m.host_bytes, m.host_source), (7, MemorySource::Given));
        assert_eq!((m.gpu_bytes, m.gpu_source), (H200_GPU_BYTES, MemorySource::AssumedH200));
        let m = MachineMemory::detect(Some(5), Some(7)).expect("both given");
        assert_eq!((m.gpu_bytes, m.gpu_source), (5, MemorySource::Given));
    }

    #[test]
    fn bad_rates_are_rejected_by_name() {
        let bad = MachineRates { adam_params: 0.0, ..MachineRates::default() };
        let err = bad.validate().expect_err("zero rate");
        assert!(err.to_string().contains("adam_params"), "{err}");
        MachineRates::default().validate().expect("defaults are valid");
    }
}
