//! The optimizer's own threads. AdamW is memory-bound and runs while the device computes, so it
//! gets a dedicated rayon pool instead of sharing the global one with data loading and the CPU
//! backend: a busy global pool would delay the update that the next forward waits for, and the
//! optimizer would steal the CPU backend's threads in the middle of a GEMM.

use std::sync::OnceLock;

use crate::error::{Error, Result};

/// A thread pool reserved for the fused AdamW update (see [`super::adamw_fused`]).
#[derive(Debug)]
pub struct AdamPool {
    pool: rayon::ThreadPool,
}

impl AdamPool {
    /// A pool of `threads` workers named `sluice-adam-<i>`; 0 means one per logical core. The
    /// threads are not pinned to cores: pinning measured no faster on the GPU machine.
    pub fn new(threads: usize) -> Result<AdamPool> {
        let threads = if threads == 0 { available_cores() } else { threads };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("sluice-adam-{i}"))
            .build()
            .map_err(|e| {
                Error::invalid(format!("cannot start {threads} optimizer threads: {e}"))
            })?;
        Ok(AdamPool { pool })
    }

    /// The process-wide pool, built on first use with one worker per logical core. Building it
    /// again after a failure is pointless (the OS refused threads), so the error is kept too.
    pub fn shared() -> Result<&'static AdamPool> {
        static SHARED: OnceLock<std::result::Result<AdamPool, String>> = OnceLock::new();
        SHARED
            .get_or_init(|| AdamPool::new(0).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| Error::invalid(e.clone()))
    }

    /// Number of worker threads.
    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Runs `f` inside the pool, so rayon's parallel iterators in `f` use its workers.
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }

    /// Runs `f(i)` once on every worker `i`, and returns when all have finished: a way to
    /// give each thread its own part of a buffer (to first-touch its pages, say).
    pub fn broadcast(&self, f: impl Fn(usize) + Sync) {
        self.pool.broadcast(|ctx| f(ctx.index()));
    }
}

/// Logical cores the process may use (1 if the OS will not say).
pub fn available_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_has_the_requested_size_and_runs_work_on_its_own_threads() {
        let pool = AdamPool::new(3).expect("three threads");
        assert_eq!(pool.threads(), 3);
        let name = pool.install(|| std::thread::current().name().map(str::to_owned));
        assert!(name.is_some_and(|n| n.starts_with("sluice-adam-")), "ran on the caller's thread");
        assert_eq!(AdamPool::new(0).expect("default").threads(), available_cores());
    }

    #[test]
    fn broadcast_runs_once_on_every_worker() {
        let pool = AdamPool::new(3).expect("three threads");
        let seen = std::sync::Mutex::new(Vec::new());
        pool.broadcast(|i| {
            let name = std::thread::current().name().map(str::to_owned);
            seen.lock().expect("lock").push((i, name));
        });
        let mut seen = seen.into_inner().expect("lock");
        seen.sort();
        assert_eq!(seen.iter().map(|s| s.0).collect::<Vec<_>>(), [0, 1, 2]);
        assert!(seen.iter().all(|s| s.1.as_deref().is_some_and(|n| n.starts_with("sluice-adam-"))));
    }

    #[test]
    fn shared_pool_is_built_once() {
        let a = AdamPool::shared().expect("shared pool");
        let b = AdamPool::shared().expect("shared pool");
        assert!(std::ptr::eq(a, b));
        assert_eq!(a.threads(), available_cores());
    }
}
