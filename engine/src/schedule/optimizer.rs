//! The optimizer worker: AdamW on the host, one unit at a time, on its own thread and thread
//! pool, so it runs while the device computes. The schedule hands it a unit once the unit's
//! gradients have landed (and, with clipping, once the global norm is known); the next step's
//! forward waits for that unit's update through [`HostStore::wait_applied`].

use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::backend::WeightDtype;
use crate::error::{Error, Result};
use crate::model::ModelLayout;
use crate::optim::{
    AdamPool, AdamW, FusedStep, GradIn, TensorStep, adamw_fused_from, adamw_step, scale,
};
use crate::store::{HostSlab, HostStore, refresh_stream};

/// Where an update finds its unit's gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradAt {
    /// The unit's own slab in the host gradient store.
    Unit,
    /// A slot of the gradient ring, freed once the update is done.
    Ring(usize),
}

/// One unit's update.
#[derive(Debug, Clone, Copy)]
pub struct AdamJob {
    pub unit: usize,
    /// 1-based optimizer step this update completes.
    pub step: u64,
    pub lr: f32,
    /// Clip coefficient applied to the gradients first (1.0: none).
    pub coef: f32,
    pub grad: GradAt,
}

/// The worker is shared by reference: the data-parallel driver's ranks hold it together, and only
/// the rank that lands gradients submits to it.
pub struct OptimizerWorker {
    tx: Mutex<Option<Sender<AdamJob>>>,
    handle: Mutex<Option<JoinHandle<Result<()>>>>,
    busy: Arc<Mutex<Duration>>,
    /// (unit, start, end) of every update since the last `take_spans`.
    spans: Arc<Mutex<Vec<(usize, Instant, Instant)>>>,
}

impl OptimizerWorker {
    /// Starts the worker with `threads` threads of its own (0: rayon's default).
    pub fn spawn(
        store: Arc<HostStore>,
        layout: Arc<ModelLayout>,
        hyper: AdamW,
        threads: usize,
    ) -> Result<OptimizerWorker> {
        let pool = AdamPool::new(threads)?;
        let (tx, rx) = channel::<AdamJob>();
        let busy = Arc::new(Mutex::new(Duration::ZERO));
        let busy_in = busy.clone();
        let spans = Arc::new(Mutex::new(Vec::new()));
        let spans_in = spans.clone();
        let handle = std::thread::Builder::new()
            .name("sluice-optimizer".into())
            .spawn(move || -> Result<()> {
                for job in rx {
                    let start = Instant::now();
                    let result = update(&pool, &store, &layout, &hyper, job);
                    if let GradAt::Ring(slot) = job.grad {
                        store.ring().release(slot)?;
                    }
                    if let Ok(mut b) = busy_in.lock() {
                        *b += start.elapsed();
                    }
                    if let Ok(mut s) = spans_in.lock() {
                        s.push((job.unit, start, Instant::now()));
                    }
                    if let Err(e) = result {
                        // Release every waiter so the schedule sees the failure instead of
                        // blocking; the error comes back through `finish`.
                        let _ = store.set_applied(u64::MAX);
                        let _ = store.ring().release_all();
                        return Err(e);
                    }
                    store.mark_applied(job.unit, job.step)?;
                }
                Ok(())
            })
            .map_err(|e| Error::invalid(format!("cannot start the optimizer thread: {e}")))?;
        Ok(OptimizerWorker {
            tx: Mutex::new(Some(tx)),
            handle: Mutex::new(Some(handle)),
            busy,
            spans,
        })
    }

    /// Queues an update; fails if the worker has stopped (its error comes from `finish`).
    pub fn submit(&self, job: AdamJob) -> Result<()> {
        let tx = self.tx.lock().map_err(|_| Error::invalid("optimizer queue poisoned"))?;
        let sent = tx.as_ref().map(|tx| tx.send(job).is_ok()).unwrap_or(false);
        if sent { Ok(()) } else { Err(Error::invalid("the optimizer worker has stopped")) }
    }

    /// Time spent updating since the last call.
    pub fn take_busy(&self) -> Duration {
        self.busy.lock().map(|mut b| std::mem::take(&mut *b)).unwrap_or_default()
    }

    /// The updates finished since the last call: (unit, start, end).
    pub fn take_spans(&self) -> Vec<(usize, Instant, Instant)> {
        self.spans.lock().map(|mut s| std::mem::take(&mut *s)).unwrap_or_default()
    }

    /// Stops the worker after its queued jobs and returns its error, if it had one.
    pub fn finish(&self) -> Result<()> {
        let poisoned = || Error::invalid("optimizer worker poisoned");
        drop(self.tx.lock().map_err(|_| poisoned())?.take());
        let handle = self.handle.lock().map_err(|_| poisoned())?.take();
        match handle.map(JoinHandle::join) {
            Some(Ok(result)) => result,
            Some(Err(_)) => Err(Error::invalid("the optimizer thread panicked")),
            None => Ok(()),
        }
    }
}

impl Drop for OptimizerWorker {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}

/// Clip, AdamW every tensor of the unit (no decay on norms and biases), refresh the streaming
/// copy where one is kept. A bf16 streaming copy (GPUs) is written in the same single pass by
/// the fused update; an f32 copy (the CPU reference) is the master itself, copied after the
/// update.
fn update(
    pool: &AdamPool,
    store: &HostStore,
    layout: &ModelLayout,
    hyper: &AdamW,
    job: AdamJob,
) -> Result<()> {
    let dtype = store.weight_dtype();
    let mut guard = store.lock(job.unit)?;
    let state = &mut *guard;
    let mut ring_slot = match job.grad {
        GradAt::Unit => None,
        GradAt::Ring(slot) => Some(store.ring().lock(slot)?),
    };
    let unit = layout
        .units
        .get(job.unit)
        .ok_or_else(|| Error::invalid(format!("no unit {}", job.unit)))?;
    let hp = AdamW { lr: job.lr, ..*hyper };
    // A disk unit's moments come from a staging slot (read ahead of this update where the
    // guess was right) and go back to the disk after it.
    let mut staged = match store.disk() {
        Some(d) if d.tier().holds(job.unit) => Some(d.acquire(job.unit)?),
        _ => None,
    };
    let (m, v) = match staged.as_mut() {
        Some(s) => s.moments(),
        None => (&mut state.m[..], &mut state.v[..]),
    };
    let (grad, half) = match ring_slot.as_deref_mut() {
        Some(slab) => (slab, false),
        None => (&mut state.grad, store.half_grads()),
    };
    let ops = Operands { master: &mut state.master, stream: &mut state.stream, grad, half, m, v };
    let result = apply(pool, store.weight_dtype(), unit, hp, job, ops);
    if let (Some(d), Some(s)) = (store.disk(), staged) {
        // Written back even after a failed update: the file then holds what the slot holds,
        // and the error stops the run before anything reads it again.
        d.release(s)?;
    }
    result?;
    if dtype != WeightDtype::Bf16 && store.keeps_copy() {
        refresh_stream(state, dtype);
    }
    Ok(())
}

/// What one update reads and writes.
struct Operands<'a> {
    master: &'a mut HostSlab,
    /// The bf16 streaming copy (empty without one).
    stream: &'a mut HostSlab,
    /// The unit's gradients: its own slab in the host store or a ring slot (the first f32s).
    grad: &'a mut HostSlab,
    /// Whether the gradients are in the weight dtype (the bf16 gradient store).
    half: bool,
    m: &'a mut [f32],
    v: &'a mut [f32],
}

/// The update proper: AdamW on the master and the moments given, fused with the bf16 copy's
/// refresh where there is one.
fn apply(
    pool: &AdamPool,
    dtype: WeightDtype,
    unit: &crate::model::UnitLayout,
    hp: AdamW,
    job: AdamJob,
    ops: Operands<'_>,
) -> Result<()> {
    let n = ops.master.bytes() / 4;
    if dtype == WeightDtype::Bf16 {
        let decayed: Vec<_> =
            unit.tensors.iter().filter(|t| t.decay).map(|t| t.range.clone()).collect();
        let args =
            FusedStep { step: job.step, lr: job.lr, hp, clip_coef: job.coef, decayed: &decayed };
        let grad = if ops.half {
            // The bf16 gradient store: widened chunk by chunk as they are used.
            GradIn::Bf16(ops.grad.as_u16())
        } else {
            GradIn::F32(ring_grad(ops.grad, n, job.unit)?)
        };
        let fused = crate::optim::UnitState {
            master: ops.master.as_f32_mut(),
            m: ops.m,
            v: ops.v,
            // Empty without a streaming copy: the fused update then writes none.
            bf16: ops.stream.as_u16_mut(),
        };
        return adamw_fused_from(pool, fused, grad, &args);
    }
    // The f32 path (the CPU): weight-dtype gradients are f32 here too.
    let grad = ring_grad(ops.grad, n, job.unit)?;
    pool.install(|| unfused(ops.master.as_f32_mut(), (ops.m, ops.v), grad, unit, &hp, job))
}

/// The first `n` f32s of a gradient slab (a ring slot may be larger): unit `unit`'s gradients.
fn ring_grad(slab: &mut HostSlab, n: usize, unit: usize) -> Result<&mut [f32]> {
    slab.as_f32_mut()
        .get_mut(..n)
        .ok_or_else(|| Error::invalid(format!("unit {unit} does not fit a gradient ring slot")))
}

/// The per-tensor update of the f32 path, with the clip applied in its own pass first.
fn unfused(
    master: &mut [f32],
    (m, v): (&mut [f32], &mut [f32]),
    grad: &mut [f32],
    unit: &crate::model::UnitLayout,
    hp: &AdamW,
    job: AdamJob,
) -> Result<()> {
    if job.coef < 1.0 {
        scale(grad, job.coef);
    }
    for t in &unit.tensors {
        let r = t.range.clone();
        adamw_step(
            &mut master[r.clone()],
            &grad[r.clone()],
            &mut m[r.clone()],
            &mut v[r],
            &TensorStep { step: job.step, lr: job.lr, hp: *hp, decay: t.decay },
        )?;
    }
    Ok(())
}
