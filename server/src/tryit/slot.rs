//! The one loaded model "try it" keeps between turns, and what it was loaded from. Plain data
//! with no notion of requests or jobs: the appliance's state holds a [`TryIt`], the service
//! ([`super`]) fills and empties it, and the dispatcher empties it before any job starts.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use sluice_engine::backend::cpu::Cpu;
use sluice_engine::backend::cuda::Cuda;
use sluice_engine::generate::Generator;

/// A loaded model not used for this long is unloaded.
pub const IDLE_UNLOAD: Duration = Duration::from_secs(300);

/// The loaded-model slot (in the appliance's state).
#[derive(Debug, Default)]
pub struct TryIt {
    slot: Mutex<Option<Loaded>>,
}

/// Where a generation runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Place {
    Cpu,
    Gpu(usize),
}

impl Place {
    pub(crate) fn id(self) -> String {
        match self {
            Place::Cpu => "cpu".into(),
            Place::Gpu(n) => format!("cuda:{n}"),
        }
    }
}

/// What a loaded model was loaded from: a checkpoint folder as it was on disk, on a device.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Key {
    dir: PathBuf,
    modified: Option<SystemTime>,
    place: Place,
}

impl Key {
    pub(crate) fn of(dir: &Path, place: Place) -> Key {
        let modified = std::fs::metadata(dir.join("config.json")).and_then(|m| m.modified()).ok();
        Key { dir: dir.to_path_buf(), modified, place }
    }
}

pub(crate) enum AnyGenerator {
    // Boxed: a generator is kilobytes of handles and buffers; the slot holds a pointer.
    Cpu(Box<Generator<Cpu>>),
    Cuda(Box<Generator<Cuda>>),
}

/// Opens the checkpoint in `dir` on `place`: the only place the appliance opens a GPU outside a
/// training thread, always on a blocking thread with the device claimed.
pub(crate) fn load(dir: &Path, place: Place) -> sluice_engine::Result<AnyGenerator> {
    Ok(match place {
        Place::Cpu => AnyGenerator::Cpu(Box::new(Generator::load_dir(dir)?)),
        Place::Gpu(n) => AnyGenerator::Cuda(Box::new(Generator::load_dir_on(Cuda::new(n)?, dir)?)),
    })
}

struct Loaded {
    key: Key,
    generator: AnyGenerator,
    last_used: Instant,
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loaded").field("key", &self.key).finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl TryIt {
    /// Empties the slot (before a job starts: its memory is the job's). Dropping a GPU model
    /// frees its memory and, with the last user of the device gone, the driver's context.
    pub fn unload(&self) {
        let loaded = lock(&self.slot).take();
        drop(loaded);
    }

    pub(crate) fn unload_idle(&self) {
        let mut slot = lock(&self.slot);
        if slot.as_ref().is_some_and(|l| l.last_used.elapsed() >= IDLE_UNLOAD) {
            let loaded = slot.take();
            drop(slot);
            drop(loaded);
        }
    }

    pub(crate) fn take(&self, key: &Key) -> Option<AnyGenerator> {
        let mut slot = lock(&self.slot);
        match slot.take() {
            Some(loaded) if loaded.key == *key => Some(loaded.generator),
            other => {
                drop(slot);
                drop(other);
                None
            }
        }
    }

    pub(crate) fn put(&self, key: Key, generator: AnyGenerator) {
        *lock(&self.slot) = Some(Loaded { key, generator, last_used: Instant::now() });
    }

    pub(crate) fn holds(&self, dir: &Path, place: Place) -> bool {
        lock(&self.slot).as_ref().is_some_and(|l| l.key.dir == dir && l.key.place == place)
    }
}
