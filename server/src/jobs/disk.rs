//! The appliance's disk tier: a folder on a local SSD (`Config::disk_tier_dir`:
//! `DATA_DIR/disk-tier`, or `SLUICE_DISK_DIR`) where a job keeps the Adam moments host memory
//! cannot hold. Measuring it (`store::disk::probe`: a file of hundreds of MiB written and read
//! back, a second or two) happens only where a job's verdict depends on a disk tier
//! (`plan::wants_disk`), once per process and folder; its free space is read again at every
//! plan, since runs create and remove their files there.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use sluice_engine::plan::{self, DiskSpace, MachineMemory, MomentsPolicy};
use sluice_engine::spec::ModelSpec;
use sluice_engine::store::disk::{free_bytes, probe};
use sluice_engine::train::Job;
use tracing::warn;

/// A failed measurement is not repeated for this long (a form plans at every keystroke); after
/// it, a folder fixed meanwhile is measured again.
const RETRY_AFTER: Duration = Duration::from_secs(60);

/// Each folder's measurement, or its failure and when it failed.
type Measured = HashMap<PathBuf, Result<DiskSpace, (String, Instant)>>;

fn measured() -> &'static Mutex<Measured> {
    static MEASURED: OnceLock<Mutex<Measured>> = OnceLock::new();
    MEASURED.get_or_init(Mutex::default)
}

/// The disk tier at `dir` now: its rates as measured the first time (the folder is created
/// then), its free bytes as they are now.
pub fn disk_space(dir: &Path) -> Result<DiskSpace, String> {
    // The lock is held through a measurement: two plans at once measure the disk once, and
    // never against each other's I/O.
    let mut cache = measured().lock().unwrap_or_else(PoisonError::into_inner);
    let known = match cache.get(dir) {
        Some(Ok(space)) => Some(space.clone()),
        Some(Err((message, at))) if at.elapsed() < RETRY_AFTER => return Err(message.clone()),
        _ => None,
    };
    let space = match known {
        Some(space) => space,
        None => match probe(dir) {
            Ok(space) => {
                cache.insert(dir.to_path_buf(), Ok(space.clone()));
                space
            }
            Err(e) => {
                let message = e.to_string();
                cache.insert(dir.to_path_buf(), Err((message.clone(), Instant::now())));
                return Err(message);
            }
        },
    };
    drop(cache);
    let bytes = free_bytes(dir).unwrap_or(space.bytes);
    Ok(DiskSpace { bytes, ..space })
}

/// `memory` with the disk tier at `dir` where `job`'s verdict depends on one (its moments asked
/// on the disk, or a job that fits only with one), else as it is. A disk tier that cannot be
/// used is an error (for the user, naming the `moments` field) only where the job asks for it;
/// otherwise the job is planned without one, as on a machine that has none.
pub fn attach(
    dir: &Path,
    job: &Job,
    spec: &ModelSpec,
    memory: MachineMemory,
) -> Result<MachineMemory, String> {
    // An invalid job is refused by the plan itself, with its own message.
    if !plan::wants_disk(&job.plan_input(spec, memory.clone())).unwrap_or(false) {
        return Ok(memory);
    }
    match disk_space(dir) {
        Ok(disk) => Ok(MachineMemory { disk: Some(disk), ..memory }),
        Err(e) if job.settings.moments == MomentsPolicy::Disk => Err(format!(
            "moments: disk keeps the Adam moments on the disk tier at {}, which cannot be used: \
             {e}",
            dir.display()
        )),
        Err(e) => {
            warn!("the disk tier at {} cannot be used: {e}", dir.display());
            Ok(memory)
        }
    }
}
