//! Layer inputs between the forward and the backward: the checkpoints (on the device, or in
//! pinned host slabs), of every layer or every K-th (the checkpoint interval), the two working
//! sets the other inputs flow through, the K - 1 buffers a group's backward recomputes its
//! inputs into, and what the layers the planner names keep of each micro-batch's forward
//! (their whole state, [`LayerScratch::for_kept`], or their attention output,
//! [`KeptAttention`]), exchanged with the layer's scratch rather than copied.
//!
//! Events owned here: `activations_ready` (compute has produced what a checkpoint copy reads,
//! or, before a checkpoint upload, has finished reading `work[0]`), `work_free` (per working
//! set: the host tier's copies out of it have finished, compute may overwrite it) and
//! `checkpoints_moved` (the checkpoint transfers queued so far, either direction, have
//! finished).

use super::{ScheduleOptions, Streams};
use crate::backend::{Backend, FloatKind};
use crate::error::{Error, Result};
use crate::model::{DeviceBatch, KeptAttention, LayerScratch};
use crate::placement::CheckpointTier;
use crate::spec::ModelSpec;
use crate::store::HostSlab;

/// Where a layer's input or output lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Act {
    /// `ckpt[l]`.
    Ckpt(usize),
    /// `work[i]`.
    Work(usize),
    /// `regen[j]`.
    Regen(usize),
}

/// The device buffers layer inputs live in, each one per micro-batch.
pub(super) struct LayerInputs<B: Backend> {
    /// Device tier: `ckpt[l][b]` is the input of layer `l` (`l = layers`: of the head); empty
    /// for layers whose input is not kept.
    ckpt: Vec<Vec<B::Floats>>,
    /// Layer inputs that are not kept (and, host tier, all of them) flow through these in the
    /// forward: layer l reads `work[l % 2]` and writes `work[(l + 1) % 2]`. The backward
    /// brings host checkpoints back into `work[0]`.
    work: [Vec<B::Floats>; 2],
    /// K > 1: `regen[j][b]` holds the recomputed input of layer `s + 1 + j` of the group that
    /// starts at layer `s`.
    regen: Vec<Vec<B::Floats>>,
}

impl<B: Backend> LayerInputs<B> {
    fn buffers(&self, a: Act) -> Option<&Vec<B::Floats>> {
        match a {
            Act::Ckpt(i) => self.ckpt.get(i),
            Act::Work(i) => self.work.get(i),
            Act::Regen(i) => self.regen.get(i),
        }
    }

    /// Micro-batch `mb` of buffer `a`.
    pub fn get(&self, a: Act, mb: usize) -> Result<&B::Floats> {
        self.buffers(a)
            .and_then(|v| v.get(mb))
            .ok_or_else(|| Error::invalid(format!("no activation buffer {a:?}[{mb}]")))
    }

    /// Micro-batch `mb` of buffer `a`, to write.
    pub fn get_mut(&mut self, a: Act, mb: usize) -> Result<&mut B::Floats> {
        let found = match a {
            Act::Ckpt(i) => at_mut(&mut self.ckpt, i, mb),
            Act::Work(i) => at_mut(&mut self.work, i, mb),
            Act::Regen(i) => at_mut(&mut self.regen, i, mb),
        };
        found.ok_or_else(|| Error::invalid(format!("no activation buffer {a:?}[{mb}]")))
    }

    /// Micro-batch `mb` of buffers `input` (read) and `output` (written), which must differ.
    pub fn pair(
        &mut self,
        input: Act,
        output: Act,
        mb: usize,
    ) -> Result<(&B::Floats, &mut B::Floats)> {
        fn split<F>(v: &mut [Vec<F>], i: usize, o: usize, mb: usize) -> Option<(&F, &mut F)> {
            if i == o || i.max(o) >= v.len() {
                return None;
            }
            let (low, high) = v.split_at_mut(i.max(o));
            let (lo, hi) = (at_mut(low, i.min(o), mb)?, at_mut(high, 0, mb)?);
            Some(if i < o { (&*lo, hi) } else { (&*hi, lo) })
        }
        let LayerInputs { ckpt, work, regen } = self;
        let found = match (input, output) {
            (Act::Ckpt(i), Act::Ckpt(o)) => split(ckpt, i, o, mb),
            (Act::Work(i), Act::Work(o)) => split(work, i, o, mb),
            (Act::Regen(i), Act::Regen(o)) => split(regen, i, o, mb),
            (Act::Ckpt(i), Act::Work(o)) => at(ckpt, i, mb).zip(at_mut(work, o, mb)),
            (Act::Ckpt(i), Act::Regen(o)) => at(ckpt, i, mb).zip(at_mut(regen, o, mb)),
            (Act::Work(i), Act::Ckpt(o)) => at(work, i, mb).zip(at_mut(ckpt, o, mb)),
            (Act::Work(i), Act::Regen(o)) => at(work, i, mb).zip(at_mut(regen, o, mb)),
            (Act::Regen(i), Act::Ckpt(o)) => at(regen, i, mb).zip(at_mut(ckpt, o, mb)),
            (Act::Regen(i), Act::Work(o)) => at(regen, i, mb).zip(at_mut(work, o, mb)),
        };
        found.ok_or_else(|| {
            Error::invalid(format!("activation buffers {input:?} -> {output:?}[{mb}] unavailable"))
        })
    }
}

fn at<F>(v: &[Vec<F>], i: usize, mb: usize) -> Option<&F> {
    v.get(i)?.get(mb)
}

fn at_mut<F>(v: &mut [Vec<F>], i: usize, mb: usize) -> Option<&mut F> {
    v.get_mut(i)?.get_mut(mb)
}

/// What a layer keeps of one micro-batch's forward for its backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kept {
    /// Its whole forward state: no recompute.
    Layer,
    /// Its attention output and log-sum-exp: the recompute skips the attention.
    Attention,
    /// Nothing: the whole recompute.
    Nothing,
}

/// Per layer and micro-batch, what the forward leaves on the device for the backward:
/// `layers[l][mb]` a layer's whole forward state, `attention[l][mb]` its attention output
/// (each empty for the layers that keep none).
pub(super) struct KeptSets<B: Backend> {
    layers: Vec<Vec<LayerScratch<B>>>,
    attention: Vec<Vec<KeptAttention<B>>>,
}

impl<B: Backend> KeptSets<B> {
    /// Exchanges `scratch`'s buffers with what layer `l` keeps for micro-batch `mb` and says
    /// what that is; its own inverse, so the forward moves the state into the set and the
    /// backward swaps it in and back out.
    pub fn swap(&mut self, scratch: &mut LayerScratch<B>, l: usize, mb: usize) -> Kept {
        if let Some(k) = self.layers[l].get_mut(mb) {
            scratch.swap_kept(k);
            Kept::Layer
        } else if let Some(a) = self.attention[l].get_mut(mb) {
            scratch.swap_attention(a);
            Kept::Attention
        } else {
            Kept::Nothing
        }
    }
}

/// Per decoder layer (`layers` of them), `g` sets made by `make` (one per micro-batch) for each
/// layer in `wanted`, none for the others; "no layer l to keep `what` of" for a layer beyond.
fn sets_per_layer<S>(
    layers: usize,
    wanted: &[usize],
    g: usize,
    what: &str,
    mut make: impl FnMut() -> Result<S>,
) -> Result<Vec<Vec<S>>> {
    let mut sets: Vec<Vec<S>> = (0..layers).map(|_| Vec::new()).collect();
    for &l in wanted {
        let set = sets
            .get_mut(l)
            .ok_or_else(|| Error::invalid(format!("no layer {l} to keep {what} of")))?;
        if set.is_empty() {
            for _ in 0..g {
                set.push(make()?);
            }
        }
    }
    Ok(sets)
}

pub(super) struct Checkpoints<B: Backend> {
    tier: CheckpointTier,
    /// K: the input of every K-th layer is kept.
    interval: usize,
    layers: usize,
    hidden: usize,
    /// The device buffers layer inputs live in.
    pub inputs: LayerInputs<B>,
    /// Host tier: `host[l][b]`, the input of layer `l` below the head, in host slabs.
    host: Vec<Vec<HostSlab>>,
    /// What each layer keeps of each micro-batch's forward for its backward.
    pub kept: KeptSets<B>,
    /// Compute has produced the activations a checkpoint copy reads (the streamer's drain
    /// also marks each stream's end with it: no step is running then).
    pub activations_ready: B::Event,
    /// Host tier: the copies out of working set i have finished; compute may overwrite it.
    work_free: [B::Event; 2],
    /// Checkpoint transfers (either direction) queued so far have finished.
    checkpoints_moved: B::Event,
}

impl<B: Backend> Checkpoints<B> {
    /// Sizes every checkpoint, working set and kept set of `spec` as the options `at` say;
    /// returns them with their device bytes.
    pub fn new(b: &B, spec: &ModelSpec, at: &ScheduleOptions) -> Result<(Self, usize)> {
        let (g, t, h) = (at.grad_accum, at.max_tokens, spec.hidden);
        let counted = std::cell::Cell::new(0usize);
        let per_mb = |n: usize| {
            let mut v = Vec::with_capacity(g);
            for _ in 0..g {
                counted.set(counted.get() + n * b.elem_bytes(FloatKind::Activation));
                v.push(b.alloc(n, FloatKind::Activation)?);
            }
            Ok::<_, Error>(v)
        };
        // Layer inputs kept between the forward and the backward: every K-th layer's, and on the
        // device the head's input too. The rest pass through the two working sets.
        let k = at.checkpoint_interval;
        let layers = spec.layers;
        let kept = |l: usize| l.is_multiple_of(k);
        let (ckpt, host) = match at.checkpoints {
            CheckpointTier::Device => {
                let c = (0..=layers)
                    .map(|l| if kept(l) || l == layers { per_mb(t * h) } else { Ok(Vec::new()) })
                    .collect::<Result<Vec<_>>>()?;
                (c, Vec::new())
            }
            CheckpointTier::Host => {
                let bytes = t * h * b.elem_bytes(FloatKind::Activation);
                let mut host = Vec::with_capacity(layers);
                for l in 0..layers {
                    let mut row = Vec::new();
                    for _ in 0..if kept(l) { g } else { 0 } {
                        let mut slab = HostSlab::zeroed(bytes)?;
                        b.pin(&mut slab)?;
                        row.push(slab);
                    }
                    host.push(row);
                }
                (Vec::new(), host)
            }
        };
        let work = if at.checkpoints == CheckpointTier::Host || k > 1 {
            [per_mb(t * h)?, per_mb(t * h)?]
        } else {
            [Vec::new(), Vec::new()]
        };
        let regen = (1..k.min(layers.max(1))).map(|_| per_mb(t * h)).collect::<Result<_>>()?;
        let keeps = !at.kept.is_empty() || !at.kept_attention.is_empty();
        if keeps && (k != 1 || at.checkpoints != CheckpointTier::Device) {
            return Err(Error::invalid(
                "kept activations need every layer's input checkpointed on the device",
            ));
        }
        if let Some(l) = at.kept_attention.iter().find(|l| at.kept.contains(l)) {
            return Err(Error::invalid(format!(
                "layer {l} keeps all its activations: its attention output is not kept twice"
            )));
        }
        let kept_layers = sets_per_layer(layers, &at.kept, g, "activations", || {
            let s = LayerScratch::for_kept(b, spec, t)?;
            counted.set(counted.get() + s.bytes);
            Ok(s)
        })?;
        let kept_attention =
            sets_per_layer(layers, &at.kept_attention, g, "the attention output", || {
                let s = KeptAttention::new(b, spec, t)?;
                counted.set(counted.get() + s.bytes);
                Ok(s)
            })?;
        let checkpoints = Checkpoints {
            tier: at.checkpoints,
            interval: k,
            layers,
            hidden: h,
            inputs: LayerInputs { ckpt, work, regen },
            host,
            kept: KeptSets { layers: kept_layers, attention: kept_attention },
            activations_ready: b.new_event()?,
            work_free: [b.new_event()?, b.new_event()?],
            checkpoints_moved: b.new_event()?,
        };
        Ok((checkpoints, counted.get()))
    }

    /// Whether the checkpoints live in host memory (they then pass through the working sets).
    pub fn on_host(&self) -> bool {
        self.tier == CheckpointTier::Host
    }

    /// The checkpoint interval K.
    pub fn interval(&self) -> usize {
        self.interval
    }

    /// Where the embedding writes its output, layer 0's input.
    pub fn embed_output(&self) -> Act {
        if self.on_host() { Act::Work(0) } else { Act::Ckpt(0) }
    }

    /// Where the forward finds layer `l`'s input and writes its output: a kept input stays in
    /// its checkpoint (device tier), every other one in a working set; the host tier copies
    /// the kept ones out of the working sets ([`Checkpoints::copies_out`]).
    pub fn forward_io(&self, l: usize) -> (Act, Act) {
        let (host, k, next) = (self.on_host(), self.interval, l + 1);
        let input = if !host && l.is_multiple_of(k) { Act::Ckpt(l) } else { Act::Work(l % 2) };
        let output = if !host && (next.is_multiple_of(k) || next == self.layers) {
            Act::Ckpt(next)
        } else {
            Act::Work(next % 2)
        };
        (input, output)
    }

    /// Whether the training forward copies layer `l`'s input out to its host checkpoint once
    /// the layer below has written it.
    pub fn copies_out(&self, l: usize) -> bool {
        self.on_host() && l.is_multiple_of(self.interval) && l < self.layers
    }

    /// The head's input.
    pub fn head_input(&self, mb: usize) -> Result<&B::Floats> {
        let layers = self.layers;
        let a = if self.on_host() { Act::Work(layers % 2) } else { Act::Ckpt(layers) };
        self.inputs.get(a, mb)
    }

    /// Where the backward finds the input of layer `l` of the group that starts at `start`: the
    /// group's first input is its checkpoint (brought into `work[0]` on the host tier), the
    /// others were recomputed.
    pub fn backward_input(&self, l: usize, start: usize) -> Act {
        match (l == start, self.on_host()) {
            (true, true) => Act::Work(0),
            (true, false) => Act::Ckpt(start),
            (false, _) => Act::Regen(l - start - 1),
        }
    }

    /// Host tier: queues the copy of layer `l`'s freshly computed input (`work[l % 2][mb]`,
    /// `tokens` rows) to its host checkpoint on `d2h`, after the compute that produced it.
    /// Returns the bytes moved.
    pub fn copy_out(
        &mut self,
        b: &B,
        streams: &Streams<B>,
        l: usize,
        mb: usize,
        tokens: usize,
    ) -> Result<u64> {
        let n = tokens * self.hidden;
        let x = self.inputs.get(Act::Work(l % 2), mb)?;
        let dst = at_mut(&mut self.host, l, mb)
            .ok_or_else(|| Error::invalid(format!("no host checkpoint of layer {l}[{mb}]")))?;
        b.record(&self.activations_ready, &streams.compute)?;
        b.wait(&streams.d2h, &self.activations_ready)?;
        // SAFETY: the checkpoint slab lives as long as the streamer; the backward reads it only
        // after `h2d` waits for `checkpoints_moved`, recorded after this copy, and compute
        // overwrites `x` only after waiting for `work_free`, also recorded after it.
        unsafe { b.download_on(&streams.d2h, dst, 0, b.view(x, 0..n))? };
        Ok((n * b.elem_bytes(FloatKind::Activation)) as u64)
    }

    /// Host tier: marks on `d2h` that the copies out of working set `i` queued so far are done.
    pub fn copied_out(&self, b: &B, d2h: &B::Stream, i: usize) -> Result<()> {
        b.record(&self.work_free[i], d2h)
    }

    /// Host tier: compute waits for the copies out of working set `i` before overwriting it.
    pub fn wait_work_free(&self, b: &B, compute: &B::Stream, i: usize) -> Result<()> {
        b.wait(compute, &self.work_free[i])
    }

    /// Host tier, end of the training forward: the backward's checkpoint uploads (on `h2d`)
    /// wait for every copy out.
    pub fn all_copied_out(&self, b: &B, streams: &Streams<B>) -> Result<()> {
        b.record(&self.checkpoints_moved, &streams.d2h)?;
        b.wait(&streams.h2d, &self.checkpoints_moved)
    }

    /// Host tier: brings layer `l`'s checkpoints of `batches` back into `work[0]`, which
    /// compute no longer reads (the upload waits for all compute queued so far); compute waits
    /// for them. Returns the bytes moved.
    pub fn bring_in(
        &mut self,
        b: &B,
        streams: &Streams<B>,
        l: usize,
        batches: &[DeviceBatch<B>],
    ) -> Result<u64> {
        let mut moved = 0;
        b.record(&self.activations_ready, &streams.compute)?;
        b.wait(&streams.h2d, &self.activations_ready)?;
        for (mb, batch) in batches.iter().enumerate() {
            let n = batch.tokens * self.hidden;
            let dst = b.view_mut(&mut self.inputs.work[0][mb], 0..n);
            // SAFETY: the checkpoint slab lives as long as the streamer and is written again only
            // by the next forward's copies out, which d2h queues after compute has consumed this
            // upload (compute waits for `checkpoints_moved` below).
            unsafe { b.upload_on(&streams.h2d, dst, &self.host[l][mb], 0)? };
            moved += (n * b.elem_bytes(FloatKind::Activation)) as u64;
        }
        b.record(&self.checkpoints_moved, &streams.h2d)?;
        b.wait(&streams.compute, &self.checkpoints_moved)?;
        Ok(moved)
    }
}

/// One layer's work in the backward: recomputing its output (the next layer's input) for the
/// group that starts at `start`, or its backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Pass {
    pub layer: usize,
    pub start: usize,
    pub recompute: bool,
}

/// The backward's passes, top group first: for the group of layers `s..e`, recompute layers
/// `s..e-1` forward, then run the backward of layers `e-1` down to `s`.
pub(super) fn backward_passes(layers: usize, k: usize) -> Vec<Pass> {
    let mut passes = Vec::new();
    let mut starts: Vec<usize> = (0..layers).step_by(k.max(1)).collect();
    starts.reverse();
    for start in starts {
        let end = (start + k).min(layers);
        passes.extend((start..end - 1).map(|layer| Pass { layer, start, recompute: true }));
        passes.extend((start..end).rev().map(|layer| Pass { layer, start, recompute: false }));
    }
    passes
}
