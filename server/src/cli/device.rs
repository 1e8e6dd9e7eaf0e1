//! `--device cpu|cuda|cuda:N`, shared by the subcommands that train or plan.

use std::fmt;
use std::str::FromStr;

use sluice_engine::plan::GpuQuery;

/// Where a job computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Device {
    Cpu,
    Cuda(usize),
}

impl FromStr for Device {
    type Err = String;

    fn from_str(s: &str) -> Result<Device, String> {
        let bad = || format!("{s:?}: expected cpu, cuda or cuda:N");
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            other => {
                let n = other.strip_prefix("cuda:").ok_or_else(bad)?;
                n.parse().map(Device::Cuda).map_err(|_| bad())
            }
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl Device {
    /// Which memory the planner reads for a job on this device.
    pub(crate) fn gpu_query(self) -> GpuQuery {
        match self {
            Device::Cpu => GpuQuery::HostOnly,
            Device::Cuda(n) => GpuQuery::Ordinal(n),
        }
    }

    /// GPU 0 when the CUDA backend can run here, else the CPU; with the reason, for the user.
    pub(crate) fn detect() -> (Device, String) {
        match sluice_engine::backend::cuda::probe() {
            Ok(n) => (Device::Cuda(0), format!("the first of {n} GPU(s)")),
            Err(e) => (Device::Cpu, format!("no usable GPU: {e}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_cpu_and_cuda_ordinals() {
        assert_eq!("cpu".parse(), Ok(Device::Cpu));
        assert_eq!("cuda".parse(), Ok(Device::Cuda(0)));
        assert_eq!("cuda:3".parse(), Ok(Device::Cuda(3)));
        for bad in ["gpu", "cuda:", "cuda:x", "cuda3"] {
            let err = bad.parse::<Device>().expect_err(bad);
            assert!(err.contains("expected cpu, cuda or cuda:N"), "{err}");
        }
        assert_eq!(Device::Cuda(2).to_string(), "cuda:2");
    }
}
