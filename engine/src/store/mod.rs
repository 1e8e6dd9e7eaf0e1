//! The host store: the authoritative home of every byte of training state. Per unit: f32 master
//! weights (a 4 KiB-aligned slab the backend page-locks, so a unit crosses PCIe in one burst),
//! f32 Adam moments m and v, optionally a streaming copy of the weights in the backend's weight
//! dtype (another such slab: half the PCIe bytes of the master for 2 more host bytes per
//! parameter; without it the device reads the master and casts it), and
//! where gradients land from the device: either an f32 slab per unit (the host gradient store,
//! when gradients must wait for the global norm and the device has no room for them) or a small
//! [`GradRing`] the optimizer worker consumes.
//!
//! The Adam moments of units the planner put on the disk tier live in a file instead
//! ([`disk`]): their `m` and `v` here are empty, and the optimizer takes them from
//! [`DiskStage::acquire`] for each update.
//!
//! Each unit sits behind its own mutex: the schedule writes gradients into a unit and reads its
//! streaming copy, the optimizer worker updates it; `applied` counts the optimizer steps a unit
//! has had, so the schedule waits for exactly the update it needs and no more.

pub mod disk;
mod dtype;
mod ring;
mod slab;

use std::sync::{Condvar, Mutex, MutexGuard};

pub use disk::{DiskStage, DiskStats, DiskTier};
pub use dtype::WeightDtype;
pub use ring::GradRing;
pub use slab::{HUGE_PAGE, HostSlab, Pages, PinGuard, SLAB_ALIGN, zeroed_f32_vec};

use crate::error::{Error, Result};

/// One unit's training state.
pub struct UnitState {
    /// f32 master weights (`as_f32`).
    pub master: HostSlab,
    /// Adam moments (empty where they live on the disk tier).
    pub m: Vec<f32>,
    pub v: Vec<f32>,
    /// The weights as the device consumes them (f32 or bf16), refreshed after every update;
    /// empty when the weights stream from the master.
    pub stream: HostSlab,
    /// f32 gradients landed from the device, waiting for the optimizer (host gradient store
    /// only; empty when gradients land in the ring).
    pub grad: HostSlab,
}

/// Where a unit's gradients land on the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradLanding {
    /// An f32 slab per unit: every unit's gradients can wait at once.
    PerUnit,
    /// The same in the backend's weight dtype (bf16 on GPUs, f32 on the CPU): half the bytes,
    /// gradients rounded after their norm was taken.
    PerUnitHalf,
    /// A ring of this many slabs, each as large as the largest unit.
    Ring(usize),
}

/// Bytes held by the host store, by part.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StoreBytes {
    pub master: usize,
    pub moments: usize,
    pub streaming: usize,
    /// The per-unit gradient store or the ring.
    pub grads: usize,
    /// Staging slots of the disk tier.
    pub disk_staging: usize,
    /// The disk tier's file (on disk, not in host memory).
    pub disk: usize,
}

impl StoreBytes {
    /// Host bytes.
    pub fn total(&self) -> usize {
        self.master + self.moments + self.streaming + self.grads + self.disk_staging
    }
}

pub struct HostStore {
    units: Vec<Mutex<UnitState>>,
    /// Empty with per-unit landing.
    ring: GradRing,
    /// Optimizer steps applied to each unit.
    applied: Mutex<Vec<u64>>,
    changed: Condvar,
    weight_dtype: WeightDtype,
    /// Whether each unit keeps a streaming copy.
    copy: bool,
    /// Whether gradients wait in the weight dtype (else f32).
    half_grads: bool,
    params: usize,
    /// The units whose moments live on disk, and their staging.
    disk: Option<DiskStage>,
}

fn poisoned() -> Error {
    Error::invalid("a training thread panicked while holding the host store")
}

impl HostStore {
    /// Takes the master weights, one vector per unit (each moved into a slab as it goes, so the
    /// peak is one unit over the store), and the count of trainable parameters among them
    /// (alignment padding excluded); moments start at zero. With `copy` every unit keeps a streaming
    /// copy in `weight_dtype`; without, the device reads the master. With `disk` (a folder and
    /// units), those units' moments live in a file created there.
    pub fn new(
        master_units: Vec<Vec<f32>>,
        params: usize,
        weight_dtype: WeightDtype,
        landing: GradLanding,
        copy: bool,
        disk: Option<(&std::path::Path, &[usize])>,
    ) -> Result<HostStore> {
        let largest = master_units.iter().map(Vec::len).max().unwrap_or(0);
        let sizes: Vec<usize> = master_units.iter().map(Vec::len).collect();
        // Created first: a disk without room fails before the host store is filled.
        let disk = match disk {
            Some((dir, on_disk)) if !on_disk.is_empty() => {
                Some(DiskStage::new(DiskTier::create(dir, &sizes, on_disk)?)?)
            }
            _ => None,
        };
        let on_disk = |u: usize| disk.as_ref().is_some_and(|d| d.tier().holds(u));
        let mut units = Vec::with_capacity(master_units.len());
        for (u, weights) in master_units.into_iter().enumerate() {
            let n = weights.len();
            let moments = if on_disk(u) { 0 } else { n };
            let grad = match landing {
                GradLanding::PerUnit => n * 4,
                GradLanding::PerUnitHalf => n * weight_dtype.bytes(),
                GradLanding::Ring(_) => 0,
            };
            let mut master = HostSlab::zeroed(n * 4)?;
            {
                use rayon::prelude::*;
                let dst = master.as_f32_mut();
                dst.par_chunks_mut(1 << 16)
                    .zip(weights.par_chunks(1 << 16))
                    .for_each(|(d, s)| d.copy_from_slice(s));
            }
            drop(weights);
            let mut state = UnitState {
                // Allocated as `sluice bench adam` measures them (marked for huge pages).
                m: zeroed_f32_vec(moments, Pages::Huge),
                v: zeroed_f32_vec(moments, Pages::Huge),
                stream: HostSlab::zeroed(if copy { n * weight_dtype.bytes() } else { 0 })?,
                grad: HostSlab::zeroed(grad)?,
                master,
            };
            if copy {
                refresh_stream(&mut state, weight_dtype);
            }
            first_touch(&mut state.m);
            first_touch(&mut state.v);
            units.push(Mutex::new(state));
        }
        let ring = match landing {
            GradLanding::PerUnit | GradLanding::PerUnitHalf => GradRing::new(0, 0)?,
            GradLanding::Ring(slots) => GradRing::new(slots, largest * 4)?,
        };
        let applied = Mutex::new(vec![0; units.len()]);
        Ok(HostStore {
            units,
            ring,
            applied,
            changed: Condvar::new(),
            weight_dtype,
            copy,
            half_grads: landing == GradLanding::PerUnitHalf,
            params,
            disk,
        })
    }

    /// The disk tier, where some units' moments live there.
    pub fn disk(&self) -> Option<&DiskStage> {
        self.disk.as_ref()
    }

    /// Calls `with(m, v)` on a unit's Adam moments, wherever they live. Only between steps,
    /// with no update running (a disk unit is read from the file).
    pub fn with_moments<R>(
        &self,
        unit: usize,
        with: impl FnOnce(&[f32], &[f32]) -> Result<R>,
    ) -> Result<R> {
        match &self.disk {
            Some(d) if d.tier().holds(unit) => {
                d.flush()?;
                d.read_unit(unit, with)
            }
            _ => {
                let state = self.lock(unit)?;
                with(&state.m, &state.v)
            }
        }
    }

    /// Sets a unit's Adam moments to what `fill(m, v)` writes, wherever they live (before the
    /// first step).
    pub fn set_moments(
        &self,
        unit: usize,
        fill: impl FnOnce(&mut [f32], &mut [f32]) -> Result<()>,
    ) -> Result<()> {
        match &self.disk {
            Some(d) if d.tier().holds(unit) => {
                d.flush()?;
                d.write_unit(unit, fill)
            }
            _ => {
                let mut state = self.lock(unit)?;
                let state = &mut *state;
                fill(&mut state.m, &mut state.v)
            }
        }
    }

    /// Parameter slots of a unit (alignment padding included).
    pub fn unit_len(&self, unit: usize) -> Result<usize> {
        Ok(self.lock(unit)?.master.bytes() / 4)
    }

    /// The gradient landing ring (empty with per-unit landing).
    pub fn ring(&self) -> &GradRing {
        &self.ring
    }

    pub fn units(&self) -> usize {
        self.units.len()
    }

    pub fn weight_dtype(&self) -> WeightDtype {
        self.weight_dtype
    }

    /// Whether units keep a streaming copy (else the device streams the master).
    pub fn keeps_copy(&self) -> bool {
        self.copy
    }

    /// Whether the per-unit gradient slabs hold the weight dtype (else f32).
    pub fn half_grads(&self) -> bool {
        self.half_grads
    }

    /// Exclusive access to one unit.
    pub fn lock(&self, unit: usize) -> Result<MutexGuard<'_, UnitState>> {
        self.units
            .get(unit)
            .ok_or_else(|| Error::invalid(format!("no unit {unit}")))?
            .lock()
            .map_err(|_| poisoned())
    }

    /// Marks `unit` as updated by optimizer step `step` and wakes waiters.
    pub fn mark_applied(&self, unit: usize, step: u64) -> Result<()> {
        let mut applied = self.applied.lock().map_err(|_| poisoned())?;
        if let Some(a) = applied.get_mut(unit) {
            *a = step;
        }
        self.changed.notify_all();
        Ok(())
    }

    /// Blocks until `unit` has had `step` optimizer steps; returns how long it waited (zero
    /// when it did not block).
    pub fn wait_applied(&self, unit: usize, step: u64) -> Result<std::time::Duration> {
        let start = std::time::Instant::now();
        let mut applied = self.applied.lock().map_err(|_| poisoned())?;
        let mut blocked = false;
        while applied.get(unit).is_some_and(|&a| a < step) {
            blocked = true;
            applied = self.changed.wait(applied).map_err(|_| poisoned())?;
        }
        Ok(if blocked { start.elapsed() } else { std::time::Duration::ZERO })
    }

    /// Sets every unit's applied count (after restoring a saved state).
    pub fn set_applied(&self, step: u64) -> Result<()> {
        let mut applied = self.applied.lock().map_err(|_| poisoned())?;
        applied.iter_mut().for_each(|a| *a = step);
        self.changed.notify_all();
        Ok(())
    }

    /// Bytes per part: 4 per parameter slot for the master, 8 for the moments held in memory, 2 (bf16, GPUs) or 4
    /// (f32, the CPU) for the streaming copy where one is kept, plus the gradient landing area: 4 per slot for a
    /// per-unit store, or the ring's slabs.
    pub fn bytes(&self) -> StoreBytes {
        let (mut slots, mut moments, mut grads) = (0, 0, self.ring.bytes());
        for u in &self.units {
            if let Ok(u) = u.lock() {
                slots += u.master.bytes() / 4;
                moments += (u.m.len() + u.v.len()) * 4;
                grads += u.grad.bytes();
            }
        }
        StoreBytes {
            master: slots * 4,
            moments,
            streaming: if self.copy { slots * self.weight_dtype.bytes() } else { 0 },
            grads,
            disk_staging: self.disk.as_ref().map_or(0, DiskStage::staging_bytes),
            disk: self.disk.as_ref().map_or(0, |d| d.tier().bytes() as usize),
        }
    }

    /// Trainable parameters (alignment padding excluded).
    pub fn params(&self) -> usize {
        self.params
    }

    /// A copy of the master weights, one vector per unit.
    pub fn snapshot(&self) -> Result<Vec<Vec<f32>>> {
        (0..self.units.len()).map(|u| self.lock(u).map(|s| s.master.as_f32().to_vec())).collect()
    }
}

/// Writes every page of a fresh moment vector now, on all cores, so the first optimizer update
/// does not pay the page faults (seconds for a 7B model's 60 GB of moments) in the middle of
/// training.
fn first_touch(v: &mut [f32]) {
    use rayon::prelude::*;
    v.par_chunks_mut(1 << 16).for_each(|chunk| {
        chunk.fill(0.0);
        // The memory is already zero: keep the compiler from proving the writes redundant.
        std::hint::black_box(chunk);
    });
}

/// Rewrites a unit's streaming copy from its master weights (bf16 by round-to-nearest-even).
pub fn refresh_stream(state: &mut UnitState, dtype: WeightDtype) {
    match dtype {
        WeightDtype::F32 => state.stream.as_f32_mut().copy_from_slice(state.master.as_f32()),
        WeightDtype::Bf16 => {
            use rayon::prelude::*;
            let (dst, src) = (state.stream.as_u16_mut(), state.master.as_f32());
            dst.par_chunks_mut(1 << 16).zip(src.par_chunks(1 << 16)).for_each(|(d, s)| {
                for (d, &x) in d.iter_mut().zip(s) {
                    *d = half::bf16::from_f32(x).to_bits();
                }
            });
        }
    }
}
