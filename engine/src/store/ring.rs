//! The gradient landing ring: a few pinned f32 slabs, each as large as the largest unit, that a
//! unit's gradients land in from the device and the optimizer worker consumes. The schedule
//! takes a free slot, fills it, hands it to the worker with the update, and the worker frees it
//! when the update is done; with two slots, one unit's update overlaps the next unit's landing.

use std::sync::{Condvar, Mutex, MutexGuard};

use super::HostSlab;
use crate::error::{Error, Result};

pub struct GradRing {
    slots: Vec<Mutex<HostSlab>>,
    /// Per slot: whether it holds gradients not yet consumed.
    busy: Mutex<Vec<bool>>,
    freed: Condvar,
}

fn poisoned() -> Error {
    Error::invalid("a training thread panicked while holding the gradient ring")
}

impl GradRing {
    /// `slots` slabs of `bytes` each (none when `slots` is 0).
    pub fn new(slots: usize, bytes: usize) -> Result<GradRing> {
        let slabs = (0..slots).map(|_| HostSlab::zeroed(bytes).map(Mutex::new));
        Ok(GradRing {
            slots: slabs.collect::<Result<_>>()?,
            busy: Mutex::new(vec![false; slots]),
            freed: Condvar::new(),
        })
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Bytes held by the ring.
    pub fn bytes(&self) -> usize {
        self.slots.iter().map(|s| s.lock().map(|s| s.bytes()).unwrap_or(0)).sum()
    }

    /// Exclusive access to one slot's slab.
    pub fn lock(&self, slot: usize) -> Result<MutexGuard<'_, HostSlab>> {
        self.slots
            .get(slot)
            .ok_or_else(|| Error::invalid(format!("no gradient ring slot {slot}")))?
            .lock()
            .map_err(|_| poisoned())
    }

    /// Blocks until `slot` is free, marks it taken and returns how long it waited (zero
    /// when it was free).
    pub fn acquire(&self, slot: usize) -> Result<std::time::Duration> {
        let start = std::time::Instant::now();
        let mut busy = self.busy.lock().map_err(|_| poisoned())?;
        if slot >= busy.len() {
            return Err(Error::invalid(format!("no gradient ring slot {slot}")));
        }
        let blocked = busy[slot];
        while busy[slot] {
            busy = self.freed.wait(busy).map_err(|_| poisoned())?;
        }
        busy[slot] = true;
        Ok(if blocked { start.elapsed() } else { std::time::Duration::ZERO })
    }

    /// Marks `slot` consumed and wakes a waiting [`GradRing::acquire`].
    pub fn release(&self, slot: usize) -> Result<()> {
        let mut busy = self.busy.lock().map_err(|_| poisoned())?;
        if let Some(b) = busy.get_mut(slot) {
            *b = false;
        }
        self.freed.notify_all();
        Ok(())
    }

    /// Frees every slot (after a failed update, so no waiter blocks forever).
    pub fn release_all(&self) -> Result<()> {
        let mut busy = self.busy.lock().map_err(|_| poisoned())?;
        busy.iter_mut().for_each(|b| *b = false);
        self.freed.notify_all();
        Ok(())
    }

    /// Every slab, for the backend to page-lock.
    pub fn slabs(&self) -> impl Iterator<Item = &Mutex<HostSlab>> {
        self.slots.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn acquire_waits_for_release() {
        let ring = Arc::new(GradRing::new(1, 16).unwrap());
        ring.acquire(0).unwrap();
        let other = ring.clone();
        let waiter = std::thread::spawn(move || other.acquire(0).map(|_| ()));
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!waiter.is_finished(), "a busy slot must not be handed out twice");
        ring.release(0).unwrap();
        waiter.join().unwrap().unwrap();
    }

    #[test]
    fn bad_slots_are_errors() {
        let ring = GradRing::new(2, 8).unwrap();
        assert_eq!(ring.len(), 2);
        assert!(ring.acquire(2).is_err());
        assert!(ring.lock(5).is_err());
    }
}
