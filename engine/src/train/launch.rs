//! Opening the devices a job names and running it there: the CPU backend, one GPU, or several
//! GPUs of this host linked through NCCL. One place for `sluice train` and the appliance.

use super::Observer;
use super::job::Devices;
use super::run::{RunOptions, RunSummary, run, run_parallel};
use crate::backend::AllReduce;
use crate::backend::cpu::Cpu;
use crate::backend::cuda::Cuda;
use crate::backend::cuda::nccl::Communicator;
use crate::error::{Error, Result};

/// Runs `options` on `devices` (see [`run`] and [`run_parallel`]).
pub fn run_on(
    devices: &Devices,
    options: &RunOptions,
    resume: bool,
    observer: &mut dyn Observer,
) -> Result<RunSummary> {
    match devices.gpus() {
        [] => run(&Cpu, options, resume, observer),
        &[ordinal] => {
            let gpu = open(ordinal)?;
            run(&gpu, options, resume, observer)
        }
        ordinals => {
            let gpus = ordinals.iter().map(|&o| open(o)).collect::<Result<Vec<_>>>()?;
            let refs: Vec<&Cuda> = gpus.iter().collect();
            let peers: Vec<Box<dyn AllReduce<Cuda>>> = Communicator::local(&refs)
                .map_err(|e| Error::invalid(format!("cannot link {devices} through NCCL: {e}")))?
                .into_iter()
                .map(|c| Box::new(c) as Box<dyn AllReduce<Cuda>>)
                .collect();
            run_parallel(&refs, peers, options, resume, observer)
        }
    }
}

fn open(ordinal: usize) -> Result<Cuda> {
    Cuda::new(ordinal).map_err(|e| Error::invalid(format!("cannot use cuda:{ordinal}: {e}")))
}
