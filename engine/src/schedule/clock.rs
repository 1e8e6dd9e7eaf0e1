//! The step's clock: what it moved (bytes each way), how long its phases took, what each unit
//! did on each stream (the timeline, in host time since the step started), and the host's
//! waits for the optimizer, measured as the compute stream's idle time across them.
//!
//! The clock owns no events: a wait is bracketed by two marks on the compute stream
//! (`Backend::mark`, read back by `Backend::elapsed` once the step is done).

use std::time::{Duration, Instant};

use crate::backend::Backend;
use crate::error::Result;
use crate::step::Span;

/// Transfer and timing figures of one step, beyond [`crate::step::StepMetrics`]' basics.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StepTraffic {
    pub h2d_bytes: u64,
    pub d2h_bytes: u64,
    pub forward: Duration,
    pub backward: Duration,
    /// Time the optimizer worker spent on updates since the previous step.
    pub optimizer_busy: Duration,
    /// Part of that the device waited for: the compute stream's idle time while the host
    /// waited for the optimizer (updates, ring slots). A wait that the work queued before it
    /// covers costs nothing; on the CPU, whose ops run on the waiting thread, every wait counts.
    pub optimizer_exposed: Duration,
    /// The disk tier's reads and writes since the previous step, and the optimizer's waits
    /// for them.
    pub disk: crate::store::DiskStats,
}

/// A host wait for the optimizer: marks on the compute stream before and after it, and how
/// long the host blocked.
struct OptimizerWait<M> {
    before: M,
    after: M,
    host: Duration,
}

pub(super) struct Clock<B: Backend> {
    /// This step's figures so far; the step fills in its phases' times at its end.
    pub traffic: StepTraffic,
    /// This step's host waits for the optimizer, for [`StepTraffic::optimizer_exposed`].
    waits: Vec<OptimizerWait<B::Mark>>,
    /// When the current step started: spans are measured from here.
    start: Instant,
    timeline: Vec<Span>,
}

impl<B: Backend> Clock<B> {
    pub fn new() -> Self {
        Clock {
            traffic: StepTraffic::default(),
            waits: Vec::new(),
            start: Instant::now(),
            timeline: Vec::new(),
        }
    }

    /// Forgets the previous step's figures: a step starting at `at` is measured from here.
    pub fn restart(&mut self, at: Instant) {
        self.traffic = StepTraffic::default();
        self.waits.clear();
        self.start = at;
        self.timeline.clear();
    }

    pub fn add_h2d(&mut self, bytes: u64) {
        self.traffic.h2d_bytes += bytes;
    }

    pub fn add_d2h(&mut self, bytes: u64) {
        self.traffic.d2h_bytes += bytes;
    }

    /// Records that `unit` used `stream` from `from` until now, for the step's timeline.
    pub fn span(&mut self, unit: usize, stream: &'static str, from: Instant) {
        let at = |t: Instant| t.saturating_duration_since(self.start).as_secs_f64();
        let span = Span { unit, stream, start: at(from), end: at(Instant::now()) };
        self.timeline.push(span);
    }

    /// Runs `wait`, which returns what it yields and how long the host blocked on the
    /// optimizer, between two marks on `compute`, so that the step reports the device's idle
    /// time across it rather than the host's wait ([`Clock::exposed`]).
    pub fn optimizer_wait<T>(
        &mut self,
        b: &B,
        compute: &B::Stream,
        wait: impl FnOnce() -> Result<(T, Duration)>,
    ) -> Result<T> {
        let before = b.mark(compute)?;
        let (out, host) = wait()?;
        if !host.is_zero() {
            let after = b.mark(compute)?;
            self.waits.push(OptimizerWait { before, after, host });
        }
        Ok(out)
    }

    /// The compute stream's idle time across this step's host waits for the optimizer, each
    /// at most the host's wait. A mark that cannot be read (timing is a diagnostic) counts the
    /// host's wait.
    pub fn exposed(&mut self, b: &B) -> Duration {
        self.waits
            .drain(..)
            .map(|w| match b.elapsed(&w.before, &w.after) {
                Ok(Some(idle)) => idle.min(w.host),
                Ok(None) | Err(_) => w.host,
            })
            .sum()
    }

    /// This step's spans plus `updates`, the optimizer's `(unit, start, end)` that finished
    /// during it, in start order.
    pub fn take_timeline(&mut self, updates: Vec<(usize, Instant, Instant)>) -> Vec<Span> {
        let origin = self.start;
        let at = |t: Instant| t.saturating_duration_since(origin).as_secs_f64();
        let mut spans = std::mem::take(&mut self.timeline);
        for (unit, from, to) in updates {
            spans.push(Span { unit, stream: "optimizer", start: at(from), end: at(to) });
        }
        spans.sort_by(|a, b| a.start.total_cmp(&b.start));
        spans
    }
}
