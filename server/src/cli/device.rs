//! `--device` for the subcommands that compute on one device (`generate`, `plan`, `bench
//! train`): the engine's one parser of device names ([`Devices`]), limited to one device.

use std::fmt;
use std::str::FromStr;

use sluice_engine::train::Devices;

/// Where a job computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Device {
    Cpu,
    Cuda(usize),
}

impl FromStr for Device {
    type Err = String;

    fn from_str(s: &str) -> Result<Device, String> {
        match s.parse::<Devices>().map_err(|e| e.to_string())? {
            Devices::Cpu => Ok(Device::Cpu),
            Devices::Cuda(ordinals) if ordinals.len() == 1 => Ok(Device::Cuda(ordinals[0])),
            Devices::Cuda(_) => Err(format!("{s:?}: this subcommand runs on one device")),
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
    /// The one device of `devices`; several GPUs are refused, naming the subcommand that
    /// trains on them.
    pub(crate) fn one_of(devices: &Devices) -> anyhow::Result<Device> {
        match devices {
            Devices::Cpu => Ok(Device::Cpu),
            Devices::Cuda(ordinals) if ordinals.len() == 1 => Ok(Device::Cuda(ordinals[0])),
            Devices::Cuda(_) => anyhow::bail!(
                "--device {devices}: this measures one device; `sluice train --device {devices}` \
                 trains on several"
            ),
        }
    }

    /// This device as a job names it.
    pub(crate) fn devices(self) -> Devices {
        match self {
            Device::Cpu => Devices::Cpu,
            Device::Cuda(n) => Devices::Cuda(vec![n]),
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
        for bad in ["gpu", "cuda:", "cuda:x", "cuda3", "cuda:-1", "CPU", ""] {
            let err = bad.parse::<Device>().expect_err(bad);
            assert!(err.contains("expected cpu, cuda, cuda:N"), "{err}");
        }
        let err = "cuda:0,1".parse::<Device>().expect_err("two");
        assert!(err.contains("one device"), "{err}");
        assert_eq!(Device::Cuda(2).to_string(), "cuda:2");
    }
}
