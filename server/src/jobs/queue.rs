//! The queue's shared state, held in `AppState`: the dispatcher's wake-ups, the devices jobs
//! and claims hold, the devices queued jobs wait for, cancel requests, and the host memory
//! starting jobs have planned. Plain data; the runner acts on it.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::Notify;

/// Wake-ups for the dispatcher, the devices running jobs hold, cancel requests for running
/// jobs, and the host memory starting jobs have planned.
#[derive(Debug, Default)]
pub struct Queue {
    pub(super) wake: Arc<Notify>,
    pub(super) busy: Mutex<HashSet<String>>,
    /// Devices a queued job waits for, as the dispatcher's latest look found them: a claim on
    /// one of them (served requests) lets go as soon as it can.
    pub(super) wanted: Mutex<HashSet<String>>,
    pub(super) cancels: Arc<Mutex<HashSet<i64>>>,
    /// Host bytes each starting job planned, until the engine reports it has allocated them
    /// (they are in MemAvailable from then on).
    pub(super) reserved: Arc<Mutex<HashMap<i64, u64>>>,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Queue {
    /// Tells the dispatcher that a job was queued or a device came free.
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    pub fn request_cancel(&self, job_id: i64) {
        lock(&self.cancels).insert(job_id);
    }

    /// Forgets a cancel request; says whether there was one.
    pub fn clear_cancel(&self, job_id: i64) -> bool {
        lock(&self.cancels).remove(&job_id)
    }

    /// Host memory a new job may plan with, of `available` (MemAvailable): what starting jobs
    /// have planned but not allocated yet is not free.
    pub fn host_budget(&self, available: u64) -> u64 {
        Self::budget(&self.reserved, available, None)
    }

    pub(super) fn budget(
        reserved: &Mutex<HashMap<i64, u64>>,
        available: u64,
        except: Option<i64>,
    ) -> u64 {
        let held: u64 =
            lock(reserved).iter().filter(|(id, _)| Some(**id) != except).map(|(_, b)| b).sum();
        available.saturating_sub(held)
    }
}
