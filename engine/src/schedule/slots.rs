//! Unit weights on the device: the streaming double buffer (slots 0 and 1), one slot per
//! resident unit (from 2 on), the fp32 staging a cast upload lands in, and the embedding table
//! a tied LM head reads. A unit's weights are prefetched on `h2d` into the free half of the
//! double buffer while the current unit computes, or into its own slot for a resident unit,
//! uploaded once per step; a unit still in a slot is not uploaded again.
//!
//! Events owned here, one of each per slot: `weights_ready` (the upload into the slot has
//! finished, compute may read it) and `slot_free` (compute has finished reading the slot, the
//! next upload may overwrite it).

use std::time::Instant;

use super::clock::Clock;
use super::{ScheduleOptions, Shared};
use crate::backend::{Backend, FloatKind};
use crate::error::{Error, Result};
use crate::model::{HeadWeights, ModelLayout};
use crate::placement::{CAST_CHUNK, WeightSource};

/// An upload a unit's weights need: into which slot, as of which optimizer step.
#[derive(Debug, Clone, Copy)]
pub(super) struct Upload {
    pub unit: usize,
    slot: usize,
    step: u64,
}

pub(super) struct WeightSlots<B: Backend> {
    /// What weights stream from: the streaming copy, or the fp32 master cast on arrival.
    source: WeightSource,
    /// Per unit, its elements.
    lens: Vec<usize>,
    /// Slots 0 and 1 are the streaming double buffer, slots from 2 on hold resident units.
    slots: Vec<B::Floats>,
    /// Where the fp32 master lands before its cast, when weights stream from the master onto a
    /// device that computes in another dtype; used only on `h2d`.
    cast_staging: Option<B::Floats>,
    /// The streaming slot the next upload goes to.
    next: usize,
    /// What each streaming slot holds (or is receiving): a unit and the optimizer step of its
    /// weights.
    holds: [Option<(usize, u64)>; 2],
    /// Per unit: its resident slot, if any, and the step whose weights that slot holds.
    resident_slot: Vec<Option<usize>>,
    resident_step: Vec<Option<u64>>,
    /// The embedding table kept on the device for a tied LM head.
    tied_table: Option<B::Floats>,
    /// Per slot: the upload into slot i has finished, compute may read it.
    weights_ready: Vec<B::Event>,
    /// Per slot: compute has finished reading slot i, the next upload may overwrite it.
    slot_free: Vec<B::Event>,
}

impl<B: Backend> WeightSlots<B> {
    /// The double buffer, a slot per resident unit, the cast staging when weights stream from
    /// the master and a tied head's table; returns them with their device bytes.
    pub fn new(
        b: &B,
        layout: &ModelLayout,
        options: &ScheduleOptions,
        tied: bool,
    ) -> Result<(Self, usize)> {
        let source = options.weights;
        let counted = std::cell::Cell::new(0usize);
        let alloc = |n: usize, kind: FloatKind| {
            counted.set(counted.get() + n * b.elem_bytes(kind));
            b.alloc(n, kind)
        };
        let lens: Vec<usize> = layout.units.iter().map(|u| u.len).collect();
        let largest = lens.iter().copied().max().unwrap_or(0);
        let mut slots =
            vec![alloc(largest, FloatKind::Activation)?, alloc(largest, FloatKind::Activation)?];
        let cast_staging = match source {
            WeightSource::Master if b.weight_dtype() != crate::backend::WeightDtype::F32 => {
                Some(alloc(largest.min(CAST_CHUNK), FloatKind::Accum)?)
            }
            _ => None,
        };
        let mut resident_slot = vec![None; lens.len()];
        for &u in &options.resident {
            let len = *lens
                .get(u)
                .ok_or_else(|| Error::invalid(format!("no unit {u} to keep resident")))?;
            if resident_slot[u].is_none() {
                resident_slot[u] = Some(slots.len());
                slots.push(alloc(len, FloatKind::Activation)?);
            }
        }
        let tied_table = if tied { Some(alloc(lens[0], FloatKind::Activation)?) } else { None };
        let n = slots.len();
        let weights = WeightSlots {
            source,
            resident_step: vec![None; lens.len()],
            lens,
            slots,
            cast_staging,
            next: 0,
            holds: [None, None],
            resident_slot,
            tied_table,
            weights_ready: (0..n).map(|_| b.new_event()).collect::<Result<_>>()?,
            slot_free: (0..n).map(|_| b.new_event()).collect::<Result<_>>()?,
        };
        Ok((weights, counted.get()))
    }

    /// Slot `i`'s weights, for compute to read once [`WeightSlots::take`] has returned `i`.
    pub fn slot(&self, i: usize) -> &B::Floats {
        &self.slots[i]
    }

    /// The head's weights in slot `i`, with the embedding table a tied head reads (an untied
    /// head never reads it).
    pub fn head(&self, i: usize) -> HeadWeights<'_, B> {
        let head = &self.slots[i];
        HeadWeights { head, embed: self.tied_table.as_ref().unwrap_or(head) }
    }

    /// The upload unit `u`'s weights of optimizer step `step` need, or `None` when they are in
    /// a slot or on their way: into its own slot when resident (uploaded once per step), else
    /// into the free half of the double buffer.
    pub fn upload_target(&self, u: usize, step: u64) -> Option<Upload> {
        let slot = match self.resident_slot[u] {
            Some(_) if self.resident_step[u] == Some(step) => return None,
            Some(slot) => slot,
            None if self.holds.contains(&Some((u, step))) => return None,
            None => self.next,
        };
        Some(Upload { unit: u, slot, step })
    }

    /// Queues `upload` (from [`WeightSlots::upload_target`]) on `h2d`, once compute has
    /// finished its reads of the slot's previous contents: for a resident slot, last step's, so
    /// the upload overlaps the layers before it. The caller has waited for the unit's pending
    /// update.
    pub fn upload(
        &mut self,
        b: &B,
        h2d: &B::Stream,
        shared: &Shared,
        upload: Upload,
        clock: &mut Clock<B>,
    ) -> Result<()> {
        let Upload { unit: u, slot, step } = upload;
        b.wait(h2d, &self.slot_free[slot])?;
        self.queue(b, h2d, shared, u, slot, clock)?;
        b.record(&self.weights_ready[slot], h2d)?;
        match self.resident_slot[u] {
            Some(_) => self.resident_step[u] = Some(step),
            None => self.holds[slot] = Some((u, step)),
        }
        Ok(())
    }

    /// Queues the copy of unit `u`'s streaming weights into `slot` on `h2d` (the caller orders
    /// it with events on either side).
    fn queue(
        &mut self,
        b: &B,
        h2d: &B::Stream,
        shared: &Shared,
        u: usize,
        slot: usize,
        clock: &mut Clock<B>,
    ) -> Result<()> {
        let len = self.lens[u];
        let started = Instant::now();
        {
            let unit = shared.store.lock(u)?;
            let dst = b.view_mut(&mut self.slots[slot], 0..len);
            // SAFETY: the streaming copy and the master live in the store for the whole run and
            // the optimizer rewrites them only in unit `u`'s next update, which is submitted
            // after the backward has read this slot (compute waits for the upload's event,
            // `weights_ready`, first, and the update only after the gradients computed from it
            // have landed). The slot and the staging are not freed while the streamer lives,
            // only `h2d` uses the staging, and the streamer drains its streams when dropped.
            unsafe {
                match self.source {
                    WeightSource::StreamingCopy => b.upload_on(h2d, dst, &unit.stream, 0)?,
                    WeightSource::Master => {
                        let staging = self.cast_staging.as_mut();
                        b.upload_f32_on(h2d, dst, &unit.master, 0, staging)?
                    }
                }
            }
        }
        clock.span(u, "h2d", started);
        let bytes = match self.source {
            WeightSource::StreamingCopy => b.weight_dtype().bytes(),
            WeightSource::Master => 4,
        };
        clock.add_h2d((len * bytes) as u64);
        Ok(())
    }

    /// The slot holding unit `u`'s weights of step `step`, uploaded or on their way
    /// ([`WeightSlots::upload`]); compute waits for the upload before it reads them.
    pub fn take(&mut self, b: &B, compute: &B::Stream, u: usize, step: u64) -> Result<usize> {
        let slot = match self.resident_slot[u] {
            Some(slot) => slot,
            None => {
                let held = self.holds.iter().position(|h| *h == Some((u, step)));
                let slot = held.ok_or_else(|| {
                    Error::invalid(format!("unit {u} is in no weight slot after its upload"))
                })?;
                // The next upload goes to the other slot, never over the one about to be read.
                self.next = 1 - slot;
                slot
            }
        };
        b.wait(compute, &self.weights_ready[slot])?;
        Ok(slot)
    }

    /// Marks the end of compute's use of `slot`: the slot's next upload waits for this mark.
    pub fn release(&self, b: &B, compute: &B::Stream, slot: usize) -> Result<()> {
        let event = self.slot_free.get(slot).ok_or_else(|| {
            Error::invalid(format!("no weight slot {slot} of {}", self.slots.len()))
        })?;
        b.record(event, compute)
    }

    /// A tied head reads the embedding table at the end of the forward: copies it (on compute)
    /// from slot `slot`, where the embedding is, rather than streaming it a second time.
    pub fn keep_table(&mut self, b: &B, slot: usize) -> Result<()> {
        if let Some(table) = &mut self.tied_table {
            let n = self.lens[0];
            b.copy(b.view_mut(table, 0..n), b.view(&self.slots[slot], 0..n))?;
        }
        Ok(())
    }
}
