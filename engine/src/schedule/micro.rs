//! The micro-batches on the device and the buffers their compute runs in: each one's token
//! data, the layer's and the head's scratch (one set, used by one op at a time), the
//! activation gradients flowing down the layers, the output a backward's recompute writes and
//! nothing reads, and a MoE model's router statistics with the load-balancing loss's weight.
//!
//! No events: no transfer stream touches these buffers, so compute's own order guards them.

use crate::backend::{Backend, FloatKind};
use crate::data::MicroBatch;
use crate::error::{Error, Result};
use crate::model::{Decoder, DeviceBatch, HeadScratch, LayerScratch, RouterStats};
use crate::spec::ModelSpec;

use super::ScheduleOptions;

/// A MoE model's router statistics, one `[2E]` per micro-batch (none for dense models), and
/// the load-balancing loss's part in this step's loss.
pub(super) struct Router<B: Backend> {
    stats: Vec<B::Floats>,
    /// `∂ loss / ∂ aux` of each micro-batch.
    weight: f32,
    /// The step's share of the mean load-balancing loss so far.
    share: Option<f64>,
}

impl<B: Backend> Router<B> {
    /// Zeroes the statistics of the first `g` micro-batches before their forward.
    pub fn clear(&mut self, b: &B, g: usize) -> Result<()> {
        for stats in self.stats.iter_mut().take(g) {
            let n = b.len(stats);
            b.fill_zero(b.view_mut(stats, 0..n))?;
        }
        Ok(())
    }

    /// Micro-batch `mb`'s statistics for its forward to add to; evaluation (`keep` false)
    /// keeps none, its loss being the cross-entropy alone.
    pub fn record(&mut self, mb: usize, keep: bool) -> RouterStats<'_, B> {
        match self.stats.get_mut(mb) {
            Some(stats) if keep => RouterStats::Record(stats),
            _ => RouterStats::Off,
        }
    }

    /// Micro-batch `mb`'s complete statistics for a recompute or a backward.
    pub fn complete(&self, mb: usize) -> RouterStats<'_, B> {
        match self.stats.get(mb) {
            Some(stats) => RouterStats::Complete { stats, weight: self.weight },
            None => RouterStats::Off,
        }
    }

    /// Sets `∂ loss / ∂ aux` for this step's micro-batches.
    pub fn set_weight(&mut self, weight: f32) {
        self.weight = weight;
    }

    /// The step's share of the load-balancing loss, summed over its micro-batches (`None`
    /// unless the last forward trained a MoE model).
    pub fn share(&self) -> Option<f64> {
        self.share
    }
}

pub(super) struct MicroBatches<B: Backend> {
    /// Largest micro-batch in tokens.
    max_tokens: usize,
    /// Token ids, positions, targets and document bounds, per micro-batch.
    pub batches: Vec<DeviceBatch<B>>,
    pub scratch: LayerScratch<B>,
    pub head: HeadScratch<B>,
    /// What a backward's recompute writes as the layer's output, read by nobody.
    pub layer_out: B::Floats,
    /// Activation gradients per micro-batch, flowing down the layers.
    pub dx: [Vec<B::Floats>; 2],
    pub router: Router<B>,
}

impl<B: Backend> MicroBatches<B> {
    /// Sizes the buffers of `options.grad_accum` micro-batches of up to `options.max_tokens`
    /// tokens; returns them with their device bytes.
    pub fn new(b: &B, spec: &ModelSpec, options: &ScheduleOptions) -> Result<(Self, usize)> {
        let (g, t, h) = (options.grad_accum, options.max_tokens, spec.hidden);
        let counted = std::cell::Cell::new(0usize);
        let alloc = |n: usize, kind: FloatKind| {
            counted.set(counted.get() + n * b.elem_bytes(kind));
            b.alloc(n, kind)
        };
        let per_mb =
            |n: usize| (0..g).map(|_| alloc(n, FloatKind::Activation)).collect::<Result<Vec<_>>>();
        let scratch = LayerScratch::new(b, spec, t)?;
        let head = HeadScratch::new(b, spec, t)?;
        let dx = [per_mb(t * h)?, per_mb(t * h)?];
        let stats = match &spec.moe {
            Some(m) => {
                (0..g).map(|_| alloc(2 * m.experts, FloatKind::Accum)).collect::<Result<_>>()?
            }
            None => Vec::new(),
        };
        let layer_out = alloc(t * h, FloatKind::Activation)?;
        let batches = (0..g).map(|_| DeviceBatch::new(b, t)).collect::<Result<_>>()?;
        // Token ids, positions, targets and document bounds: four i32 arrays per micro-batch.
        let batch_bytes = g * (4 * t + 1) * 4;
        let bytes = counted.get() + scratch.bytes + head.bytes + batch_bytes;
        let micro = MicroBatches {
            max_tokens: t,
            batches,
            scratch,
            head,
            layer_out,
            dx,
            router: Router { stats, weight: 0.0, share: None },
        };
        Ok((micro, bytes))
    }

    /// Copies the token data of up to G micro-batches to the device.
    pub fn upload(&mut self, b: &B, micro: &[MicroBatch]) -> Result<()> {
        if micro.len() > self.batches.len() {
            return Err(Error::invalid(format!(
                "{} micro-batches at once, the schedule holds {}",
                micro.len(),
                self.batches.len()
            )));
        }
        for (dev, mb) in self.batches.iter_mut().zip(micro) {
            if mb.ids.len() > self.max_tokens {
                return Err(Error::invalid(format!(
                    "micro-batch of {} tokens exceeds the {} the schedule was sized for",
                    mb.ids.len(),
                    self.max_tokens
                )));
            }
            dev.upload(b, &mb.ids, &mb.positions, &mb.targets, &mb.cu_seqlens)?;
        }
        Ok(())
    }

    /// Measures the load-balancing loss of the first `g` micro-batches from their complete
    /// router statistics, when `train`ing a MoE model; forgets the previous forward's.
    pub fn measure_aux(
        &mut self,
        b: &B,
        decoder: &Decoder<B>,
        g: usize,
        train: bool,
    ) -> Result<()> {
        let router = &mut self.router;
        router.share = None;
        if train {
            for (stats, batch) in router.stats.iter().zip(&self.batches).take(g) {
                let aux = decoder.aux_loss(b, stats, batch.tokens)?;
                *router.share.get_or_insert(0.0) += aux;
            }
        }
        Ok(())
    }
}
