//! The plain training loop: micro-batch by micro-batch, every unit resident on the backend.
//!
//! This is the reference schedule against which the streaming schedule is checked. Per
//! micro-batch: the forward keeps each layer's input as a checkpoint; the head computes the loss
//! and its gradient; the backward recomputes each layer's internals from its checkpoint and
//! accumulates weight gradients (f32) across micro-batches. After the last micro-batch the
//! gradients come to the host, are clipped by their global norm, and AdamW updates the f32
//! master weights, which are then sent back.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{StepMetrics, TrainConfig};
use crate::backend::{Backend, FloatKind};
use crate::data::MicroBatch;
use crate::error::{Error, Result};
use crate::model::{
    Decoder, DeviceBatch, HeadGrads, HeadScratch, HeadWeights, HostParams, LayerAt, LayerGrads,
    LayerScratch, ModelLayout, RouterStats,
};
use crate::optim::{AdamW, TensorStep, adamw_step, clip_grad_norm, sum_of_squares};
use crate::spec::ModelSpec;

/// Training state: master weights and Adam moments on the host, a working copy of every unit
/// on the backend.
pub struct Trainer<'b, B: Backend> {
    b: &'b B,
    pub config: TrainConfig,
    pub params: HostParams,
    /// Adam first and second moments, laid out like `params`.
    m: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    /// Optimizer steps taken.
    pub step: u64,
    decoder: Decoder<B>,
    weights: Vec<B::Floats>,
    grads: Vec<B::Floats>,
    host_grads: Vec<Vec<f32>>,
    /// Layer inputs of the current micro-batch: `checkpoints[l]` is the input of layer `l`,
    /// `checkpoints[layers]` the head's input.
    checkpoints: Vec<B::Floats>,
    dx: [B::Floats; 2],
    layer_out: B::Floats,
    scratch: LayerScratch<B>,
    head: HeadScratch<B>,
    batch: DeviceBatch<B>,
    /// A MoE model's router statistics of the current micro-batch.
    stats: Option<B::Floats>,
    /// The last `loss_and_grads`'s mean load-balancing loss (MoE models).
    aux_loss: Option<f64>,
    max_tokens: usize,
}

impl<'b, B: Backend> Trainer<'b, B> {
    /// Sets up training of `params` on `b` for micro-batches of up to `max_tokens` tokens.
    pub fn new(
        b: &'b B,
        spec: &ModelSpec,
        params: HostParams,
        config: TrainConfig,
        max_tokens: usize,
    ) -> Result<Self> {
        if max_tokens == 0 {
            return Err(Error::invalid("a micro-batch must hold at least one token"));
        }
        let layout: Arc<ModelLayout> = params.layout.clone();
        if *layout != ModelLayout::new(spec) {
            return Err(Error::invalid("parameters do not match the model spec's layout"));
        }
        let decoder = Decoder::new(b, spec, layout.layers.clone(), layout.head.clone())?;
        let stats = decoder.router_stats(b)?;
        let mut weights = Vec::with_capacity(layout.units.len());
        let mut grads = Vec::with_capacity(layout.units.len());
        for (unit, host) in layout.units.iter().zip(&params.units) {
            let mut w = b.alloc(unit.len, FloatKind::Activation)?;
            b.upload(b.view_mut(&mut w, 0..unit.len), host)?;
            weights.push(w);
            grads.push(b.alloc(unit.len, FloatKind::Accum)?);
        }
        let th = max_tokens * spec.hidden;
        let checkpoints =
            (0..=spec.layers).map(|_| b.alloc(th, FloatKind::Activation)).collect::<Result<_>>()?;
        let zeros = || layout.units.iter().map(|u| vec![0.0; u.len]).collect::<Vec<_>>();
        Ok(Trainer {
            b,
            config,
            m: zeros(),
            v: zeros(),
            host_grads: zeros(),
            params,
            step: 0,
            decoder,
            weights,
            grads,
            checkpoints,
            dx: [b.alloc(th, FloatKind::Activation)?, b.alloc(th, FloatKind::Activation)?],
            layer_out: b.alloc(th, FloatKind::Activation)?,
            scratch: LayerScratch::new(b, spec, max_tokens)?,
            head: HeadScratch::new(b, spec, max_tokens)?,
            batch: DeviceBatch::new(b, max_tokens)?,
            stats,
            aux_loss: None,
            max_tokens,
        })
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.decoder.spec
    }

    /// The mean load-balancing loss of the last step or `loss_and_grads` (MoE models).
    pub fn aux_loss(&self) -> Option<f64> {
        self.aux_loss
    }

    /// The learning rate the next step will use.
    pub fn next_lr(&self) -> f32 {
        self.config.lr_at(self.step)
    }

    fn upload_batch(&mut self, mb: &MicroBatch) -> Result<()> {
        if mb.ids.len() > self.max_tokens {
            return Err(Error::invalid(format!(
                "micro-batch of {} tokens exceeds the {} the trainer was sized for",
                mb.ids.len(),
                self.max_tokens
            )));
        }
        self.batch.upload(self.b, &mb.ids, &mb.positions, &mb.targets, &mb.cu_seqlens)
    }

    /// Uploads `mb` and runs the embedding and every layer, leaving each layer's input in
    /// `checkpoints` (the last one is the head's input) and a MoE model's router statistics in
    /// `stats`.
    fn forward_layers(&mut self, mb: &MicroBatch) -> Result<()> {
        self.upload_batch(mb)?;
        let (b, d) = (self.b, &self.decoder);
        d.embed_forward(b, &mut self.checkpoints[0], &self.weights[0], &self.batch)?;
        if let Some(stats) = &mut self.stats {
            let n = b.len(stats);
            b.fill_zero(b.view_mut(stats, 0..n))?;
        }
        for l in 0..d.spec.layers {
            let (done, rest) = self.checkpoints.split_at_mut(l + 1);
            let router = match &mut self.stats {
                Some(stats) => RouterStats::Record(stats),
                None => RouterStats::Off,
            };
            d.layer_forward(
                b,
                &mut rest[0],
                &done[l],
                &self.weights[l + 1],
                &mut self.scratch,
                LayerAt::packed(&self.batch, l).with_router(router),
            )?;
        }
        Ok(())
    }

    /// Logits `[T, V]` of one micro-batch (materialised: for checks and generation on small
    /// batches).
    pub fn logits(&mut self, mb: &MicroBatch) -> Result<Vec<f32>> {
        self.forward_layers(mb)?;
        let (b, d) = (self.b, &self.decoder);
        let (t, v) = (mb.ids.len(), d.spec.vocab);
        let mut out = b.alloc(t * v, FloatKind::Accum)?;
        let head = self.weights.len() - 1;
        d.logits(
            b,
            &mut out,
            &mut self.head,
            &self.checkpoints[d.spec.layers],
            0..t,
            HeadWeights { head: &self.weights[head], embed: &self.weights[0] },
        )?;
        let mut host = vec![0.0; t * v];
        b.download(&mut host, b.view(&out, 0..t * v))?;
        d.finish_logits(&mut host);
        Ok(host)
    }

    /// Forward and backward of one micro-batch; returns the summed token loss and a MoE
    /// model's load-balancing loss. Weight gradients accumulate into `self.grads`: the
    /// cross-entropy's scaled by `scale`, the load-balancing loss's by `aux_weight`.
    fn forward_backward(
        &mut self,
        mb: &MicroBatch,
        scale: f32,
        aux_weight: f32,
    ) -> Result<(f64, Option<f64>)> {
        self.forward_layers(mb)?;
        let (b, layers, head) = (self.b, self.decoder.spec.layers, self.weights.len() - 1);
        let d = &self.decoder;
        let aux = match &self.stats {
            Some(stats) => Some(d.aux_loss(b, stats, mb.ids.len())?),
            None => None,
        };
        let (embed_w, rest_w) = self.weights.split_at(1);
        let loss = d.head_forward(
            b,
            &mut self.head,
            &self.checkpoints[layers],
            HeadWeights { head: &rest_w[head - 1], embed: &embed_w[0] },
            &self.batch,
        )?;
        {
            let (embed_g, rest_g) = self.grads.split_at_mut(1);
            d.head_backward(
                b,
                HeadGrads {
                    scale,
                    dx: &mut self.dx[0],
                    head: &mut rest_g[head - 1],
                    embed: Some(&mut embed_g[0]),
                },
                &mut self.head,
                &self.checkpoints[layers],
                HeadWeights { head: &rest_w[head - 1], embed: &embed_w[0] },
                &self.batch,
            )?;
        }
        fn complete<B: Backend>(stats: &Option<B::Floats>, weight: f32) -> RouterStats<'_, B> {
            match stats {
                Some(stats) => RouterStats::Complete { stats, weight },
                None => RouterStats::Off,
            }
        }
        for l in (0..layers).rev() {
            // Recompute the layer's internals from its checkpoint, then backprop through it.
            d.layer_forward(
                b,
                &mut self.layer_out,
                &self.checkpoints[l],
                &self.weights[l + 1],
                &mut self.scratch,
                LayerAt::packed(&self.batch, l).with_router(complete(&self.stats, aux_weight)),
            )?;
            let [dx_out, dx_in] = &mut self.dx;
            d.layer_backward(
                b,
                LayerGrads { dx_out, dx_in, weights: &mut self.grads[l + 1] },
                &self.checkpoints[l],
                &self.weights[l + 1],
                &mut self.scratch,
                LayerAt::packed(&self.batch, l).with_router(complete(&self.stats, aux_weight)),
            )?;
            self.dx.swap(0, 1);
        }
        d.embed_backward(b, &mut self.grads[0], &self.dx[0], &self.batch)?;
        Ok((loss, aux))
    }

    /// Loss and gradients of one step's micro-batches without updating anything: the gradients
    /// (mean over trained tokens, not clipped) are left in the host copy returned.
    pub fn loss_and_grads(&mut self, micro: &[MicroBatch]) -> Result<(f64, &[Vec<f32>])> {
        let trained = trained_tokens(micro);
        if trained == 0 {
            return Err(Error::invalid(
                "no token in this step carries loss (all are prompt or padding)",
            ));
        }
        for g in &mut self.grads {
            let n = self.b.len(g);
            self.b.fill_zero(self.b.view_mut(g, 0..n))?;
        }
        let scale = 1.0 / trained as f32;
        // The load-balancing loss counts once per micro-batch, averaged over the step.
        let aux_coef = self.decoder.spec.moe.as_ref().filter(|m| m.aux_in_loss).map(|m| m.aux_coef);
        let aux_weight = aux_coef.map_or(0.0, |c| c / micro.len() as f32);
        let (mut loss_sum, mut aux_sum) = (0.0, None::<f64>);
        for mb in micro {
            let (loss, aux) = self.forward_backward(mb, scale, aux_weight)?;
            loss_sum += loss;
            if let Some(aux) = aux {
                *aux_sum.get_or_insert(0.0) += aux;
            }
        }
        for (host, dev) in self.host_grads.iter_mut().zip(&self.grads) {
            let n = host.len();
            self.b.download(host, self.b.view(dev, 0..n))?;
        }
        self.aux_loss = aux_sum.map(|a| a / micro.len() as f64);
        let aux_term = match (aux_coef, self.aux_loss) {
            (Some(c), Some(a)) => f64::from(c) * a,
            _ => 0.0,
        };
        Ok((loss_sum / trained as f64 + aux_term, &self.host_grads))
    }

    /// One optimizer step over `micro` (the G micro-batches of the global batch).
    pub fn step(&mut self, micro: &[MicroBatch]) -> Result<StepMetrics> {
        let start = Instant::now();
        let tokens = micro.iter().map(|m| m.ids.len()).sum();
        let trained = trained_tokens(micro);
        let (loss, _) = self.loss_and_grads(micro)?;
        let compute_time = start.elapsed();
        if !loss.is_finite() {
            return Err(Error::Numerical(format!("loss is {loss} at step {}", self.step + 1)));
        }

        let opt_start = Instant::now();
        let grad_norm = match self.config.max_grad_norm {
            Some(max_norm) => {
                let mut views: Vec<&mut [f32]> =
                    self.host_grads.iter_mut().map(|g| g.as_mut_slice()).collect();
                f64::from(clip_grad_norm(&mut views, max_norm)?)
            }
            None => self.host_grads.iter().map(|g| sum_of_squares(g)).sum::<f64>().sqrt(),
        };
        if !grad_norm.is_finite() {
            return Err(Error::Numerical(format!(
                "gradient norm is {grad_norm} at step {}",
                self.step + 1
            )));
        }
        let lr = self.next_lr();
        let hp = AdamW {
            lr,
            beta1: self.config.beta1,
            beta2: self.config.beta2,
            eps: self.config.eps,
            weight_decay: self.config.weight_decay,
        };
        self.step += 1;
        let layout = self.params.layout.clone();
        for (u, t) in layout.tensors() {
            let r = t.range.clone();
            adamw_step(
                &mut self.params.units[u][r.clone()],
                &self.host_grads[u][r.clone()],
                &mut self.m[u][r.clone()],
                &mut self.v[u][r],
                &TensorStep { step: self.step, lr, hp, decay: t.decay },
            )?;
        }
        for (dev, host) in self.weights.iter_mut().zip(&self.params.units) {
            self.b.upload(self.b.view_mut(dev, 0..host.len()), host)?;
        }
        let optimizer_time = opt_start.elapsed();
        Ok(StepMetrics {
            step: self.step,
            loss,
            aux_loss: self.aux_loss,
            lr,
            grad_norm,
            tokens,
            trained_tokens: trained,
            elapsed: start.elapsed(),
            compute_time,
            // The reference interleaves the phases per micro-batch; it reports them as one.
            forward_time: compute_time,
            backward_time: Duration::ZERO,
            optimizer_time,
            // Everything is resident and the optimizer runs inline: nothing moves, nothing hides.
            optimizer_exposed: optimizer_time,
            h2d_bytes: 0,
            d2h_bytes: 0,
            timeline: Vec::new(),
            eval_loss: None,
        })
    }

    /// Mean loss over micro-batches without touching gradients' effect on weights (evaluation).
    pub fn eval_loss(&mut self, micro: &[MicroBatch]) -> Result<f64> {
        let trained = trained_tokens(micro);
        if trained == 0 {
            return Err(Error::invalid("no token in the evaluation set carries loss"));
        }
        let mut sum = 0.0;
        for mb in micro {
            self.forward_layers(mb)?;
            let (b, d, head) = (self.b, &self.decoder, self.weights.len() - 1);
            let x = &self.checkpoints[d.spec.layers];
            sum += d.head_forward(
                b,
                &mut self.head,
                x,
                HeadWeights { head: &self.weights[head], embed: &self.weights[0] },
                &self.batch,
            )?;
        }
        Ok(sum / trained as f64)
    }
}

fn trained_tokens(micro: &[MicroBatch]) -> usize {
    micro.iter().map(MicroBatch::trained_tokens).sum()
}
