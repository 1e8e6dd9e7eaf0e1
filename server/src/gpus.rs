//! The devices jobs run on: GPUs through NVML (loaded at run time, so the binary runs on
//! machines without NVIDIA's library) and the CPU, which is always there and is one device.

use nvml_wrapper::Nvml;
use serde::Serialize;
use tracing::info;

#[derive(Debug, Clone, Serialize)]
pub struct DeviceInfo {
    /// "cpu" or "cuda:<index>".
    pub id: String,
    pub name: String,
    pub memory_total: u64,
    pub memory_used: u64,
    /// Percent busy over NVML's last sample period; `null` for the CPU.
    pub utilization: Option<u32>,
    /// Current PCIe link, e.g. "Gen5 x16"; `null` for the CPU.
    pub pcie: Option<String>,
}

/// NVML when it loaded; the device list is fixed at start (one job runner per device).
pub struct Gpus {
    nvml: Option<Nvml>,
    count: u32,
}

impl std::fmt::Debug for Gpus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpus")
            .field("nvml", &self.nvml.is_some())
            .field("count", &self.count)
            .finish()
    }
}

impl Gpus {
    /// Loads NVML; on any failure only the CPU is listed, and the reason is logged once.
    pub fn detect() -> Gpus {
        match Nvml::init() {
            Ok(nvml) => {
                let count = nvml.device_count().unwrap_or(0);
                info!("NVML: {count} GPU(s)");
                Gpus { nvml: Some(nvml), count }
            }
            Err(err) => {
                info!("no GPU listed (NVML: {err}); jobs run on the CPU");
                Gpus::none()
            }
        }
    }

    /// Only the CPU (for tests and machines without NVML).
    pub fn none() -> Gpus {
        Gpus { nvml: None, count: 0 }
    }

    /// "cpu" then "cuda:0".. in index order.
    pub fn device_ids(&self) -> Vec<String> {
        std::iter::once("cpu".to_string())
            .chain((0..self.count).map(|i| format!("cuda:{i}")))
            .collect()
    }

    /// Each device with its memory and use right now.
    pub fn list(&self) -> Vec<DeviceInfo> {
        let mut devices = vec![cpu_info()];
        if let Some(nvml) = &self.nvml {
            for index in 0..self.count {
                let Ok(device) = nvml.device_by_index(index) else { continue };
                let memory = device.memory_info().ok();
                let pcie = match (device.current_pcie_link_gen(), device.current_pcie_link_width())
                {
                    (Ok(generation), Ok(width)) => Some(format!("Gen{generation} x{width}")),
                    _ => None,
                };
                devices.push(DeviceInfo {
                    id: format!("cuda:{index}"),
                    name: device.name().unwrap_or_else(|_| format!("GPU {index}")),
                    memory_total: memory.as_ref().map_or(0, |m| m.total),
                    memory_used: memory.as_ref().map_or(0, |m| m.used),
                    utilization: device.utilization_rates().ok().map(|u| u.gpu),
                    pcie,
                });
            }
        }
        devices
    }
}

/// The CPU as a device: its model name and the machine's RAM (Linux `/proc`; zeros elsewhere).
fn cpu_info() -> DeviceInfo {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|line| line.strip_prefix("model name")?.split_once(':').map(|(_, v)| v.trim()))
        .unwrap_or("CPU");
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (total, available) = host_memory();
    DeviceInfo {
        id: "cpu".into(),
        name: format!("{model} ({threads} threads)"),
        memory_total: total,
        memory_used: total.saturating_sub(available),
        utilization: None,
        pcie: None,
    }
}

/// (MemTotal, MemAvailable) in bytes from `/proc/meminfo`.
pub fn host_memory() -> (u64, u64) {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |name: &str| {
        meminfo
            .lines()
            .find_map(|line| {
                line.strip_prefix(name)?.trim().strip_suffix("kB")?.trim().parse().ok()
            })
            .map_or(0u64, |kb: u64| kb * 1024)
    };
    (field("MemTotal:"), field("MemAvailable:"))
}

/// This process's resident memory in bytes (Linux `/proc/self/statm`; 0 elsewhere).
pub fn process_rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm.split_whitespace().nth(1).and_then(|p| p.parse().ok()).unwrap_or(0);
    pages * 4096
}
