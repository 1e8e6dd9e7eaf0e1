//! A decoder layer's mixture-of-experts MLP, forward and backward, on any [`Backend`]
//! (`MixtralSparseMoeBlock`, `Qwen3MoeSparseMoeBlock`, `GptOssMLP` in transformers):
//! ```text
//! z   = h · Wrᵀ (+ br)                          [T, E]   router logits
//! w, e = route(z)                               [T, k]   weights and experts per token
//! xs  = h[pairs sorted by expert]               [T k, H]
//! y   = down_e(act(gate_up_e(xs)))              [T k, H] every expert on its rows
//! out = Σ_j w[t, j] · y[row of (t, j)]          [T, H]
//! out += sigmoid(h · wgᵀ) · shared(h)            [T, H]   Qwen2 MoE's shared expert
//! ```
//! The load-balancing loss (`load_balancing_loss_func`) is a function of the whole forward:
//! `E Σ_e c_e P_e / N²` over the `N = T · (MoE layers)` routed rows of a micro-batch, with
//! `c_e` the pairs routed to expert `e` and `P_e` the summed router probabilities, over all MoE
//! layers. Each layer's first forward adds its counts and sums to the micro-batch's
//! [`RouterStats`]; the backward, which runs after the whole forward, reads the totals.

use super::decoder::{Decoder, LayerScratch};
use super::layout::MoeRanges;
use crate::backend::{
    Backend, FloatKind, Grads, GroupedShape, MatmulShape, MoeShape, Operands, Routing,
};
use crate::error::{Error, Result};
use crate::spec::{ModelSpec, MoeSpec};

/// A micro-batch's router statistics as a layer call sees them.
pub enum RouterStats<'a, B: Backend> {
    /// None kept: generation, evaluation.
    Off,
    /// The micro-batch's forward: each MoE layer adds its counts and probability sums
    /// (`[2E]`, zeroed by the caller before the first layer).
    Record(&'a mut B::Floats),
    /// A recompute or a backward after the whole forward: the totals are complete, and the
    /// backward adds the load-balancing loss's gradient times `weight` (`∂ loss / ∂ aux`).
    Complete { stats: &'a B::Floats, weight: f32 },
}

/// Which MoE MLP a layer call runs, on how many tokens, where its output goes, and what its
/// router keeps.
pub(super) struct MoeAt<'a, B: Backend> {
    pub ranges: &'a MoeRanges,
    pub moe: &'a MoeSpec,
    pub tokens: usize,
    /// A post-MLP norm follows (Gemma's sandwich norms): the forward's output goes to
    /// `s.m_pre` rather than `s.tmp_h`, and the backward finds its output's gradient in
    /// `s.d_pre`, where that norm's backward left it, rather than in `dx_out`.
    pub post_norm: bool,
    /// The forward records into [`RouterStats::Record`]; the backward adds the load-balancing
    /// loss's gradient from [`RouterStats::Complete`] when its weight is not zero.
    pub router: RouterStats<'a, B>,
}

/// The MoE intermediates of one layer for `T` tokens (`R = T k` routed rows).
pub(super) struct MoeScratch<B: Backend> {
    logits: B::Floats,  // [T, E] f32
    probs: B::Floats,   // [T, E] f32
    weights: B::Floats, // [T, k] f32
    experts: B::Ints,   // [T, k]
    order: B::Ints,     // [R]
    rows: B::Ints,      // [R]
    xs: B::Floats,      // [R, H]
    gate_up: B::Floats, // [R, 2I]
    act: B::Floats,     // [R, I]
    y: B::Floats,       // [R, H]
    // gradients
    d_logits: B::Floats,  // [T, E]
    d_weights: B::Floats, // [T, k] f32
    d_y: B::Floats,       // [R, H]; also the router's input gradient [T, H]
    d_act: B::Floats,     // [R, I]
    d_gate_up: B::Floats, // [R, 2I]
    d_xs: B::Floats,      // [R, H]
    /// Qwen2 MoE's shared expert (empty buffers elsewhere): its gate/up projection `[T, 2Is]`,
    /// activation `[T, Is]`, output `[T, H]`, gate logit `[T]` (f32), and their gradients.
    s_gate_up: B::Floats,
    s_act: B::Floats,
    s_y: B::Floats,
    s_logit: B::Floats,
    d_s_gate_up: B::Floats,
    d_s_act: B::Floats,
    d_s_y: B::Floats,
    d_s_logit: B::Floats,
    /// Expert `e`'s rows, from the last forward.
    offsets: Vec<usize>,
    /// Experts per layer (`E`).
    width: usize,
}

impl<B: Backend> MoeScratch<B> {
    /// Buffers for `tokens` tokens, gradients only when `train`; returns them with their bytes.
    pub(super) fn new(
        b: &B,
        spec: &ModelSpec,
        tokens: usize,
        train: bool,
    ) -> Result<(Self, usize)> {
        let Some(m) = &spec.moe else {
            return Err(Error::invalid("a MoE scratch needs a MoE model"));
        };
        let (t, h, e, k, i) = (tokens, spec.hidden, m.experts, m.top_k, m.inter);
        let r = t * k;
        let g = usize::from(train);
        // The shared expert's width, 0 without one.
        let si = m.shared_inter.unwrap_or(0);
        let sh = usize::from(si > 0);
        let mut bytes = 0;
        let mut alloc = |n: usize, kind: FloatKind| {
            bytes += n * b.elem_bytes(kind);
            b.alloc(n, kind)
        };
        use FloatKind::{Accum, Activation};
        let scratch = MoeScratch {
            // f32: a routing decision compares logits, which bf16 would round together.
            logits: alloc(t * e, Accum)?,
            probs: alloc(t * e, Accum)?,
            weights: alloc(t * k, Accum)?,
            xs: alloc(r * h, Activation)?,
            gate_up: alloc(r * 2 * i, Activation)?,
            act: alloc(r * i, Activation)?,
            y: alloc(r * h, Activation)?,
            d_logits: alloc(g * t * e, Activation)?,
            d_weights: alloc(g * t * k, Accum)?,
            d_y: alloc(g * r * h, Activation)?,
            d_act: alloc(g * r * i, Activation)?,
            d_gate_up: alloc(g * r * 2 * i, Activation)?,
            d_xs: alloc(g * r * h, Activation)?,
            s_gate_up: alloc(t * 2 * si, Activation)?,
            s_act: alloc(t * si, Activation)?,
            s_y: alloc(sh * t * h, Activation)?,
            s_logit: alloc(sh * t, Accum)?,
            d_s_gate_up: alloc(g * t * 2 * si, Activation)?,
            d_s_act: alloc(g * t * si, Activation)?,
            d_s_y: alloc(g * sh * t * h, Activation)?,
            d_s_logit: alloc(g * sh * t, Activation)?,
            experts: b.alloc_ints(r)?,
            order: b.alloc_ints(r)?,
            rows: b.alloc_ints(r)?,
            offsets: Vec::new(),
            width: e,
        };
        Ok((scratch, bytes + 3 * r * 4))
    }
}

impl<B: Backend> super::decoder::LayerScratch<B> {
    /// The router logits `[T, E]` of the last MoE layer forward run on this scratch (for
    /// inspection: which experts were close to a tie), or `None` for a dense model.
    pub fn router_logits(&self, b: &B, tokens: usize) -> Result<Option<Vec<f32>>> {
        let Some(x) = &self.moe else { return Ok(None) };
        let n = tokens * x.width;
        if n > b.len(&x.logits) {
            return Err(Error::invalid(format!(
                "the scratch holds router logits for {} tokens, not {tokens}",
                b.len(&x.logits) / x.width.max(1)
            )));
        }
        let mut out = vec![0.0; n];
        b.download(&mut out, b.view(&x.logits, 0..n))?;
        Ok(Some(out))
    }
}

impl<B: Backend> Decoder<B> {
    fn moe_shape(&self, m: &MoeSpec, tokens: usize) -> MoeShape {
        MoeShape {
            tokens,
            hidden: self.spec.hidden,
            experts: m.experts,
            top_k: m.top_k,
            router: m.router,
        }
    }

    /// A zeroed `[2E]` statistics buffer for one micro-batch, or `None` for a dense model.
    pub fn router_stats(&self, b: &B) -> Result<Option<B::Floats>> {
        self.spec.moe.as_ref().map(|m| b.alloc(2 * m.experts, FloatKind::Accum)).transpose()
    }

    /// The micro-batch's load-balancing loss from its complete statistics (`tokens` tokens):
    /// `E Σ_e c_e P_e / N²`, `N = tokens · MoE layers` (transformers' `load_balancing_loss_func`
    /// without an attention mask).
    pub fn aux_loss(&self, b: &B, stats: &B::Floats, tokens: usize) -> Result<f64> {
        let Some(m) = &self.spec.moe else { return Ok(0.0) };
        let e = m.experts;
        let mut host = vec![0.0f32; 2 * e];
        b.download(&mut host, b.view(stats, 0..2 * e))?;
        let n = (tokens * m.sparse_layers()) as f64;
        if n == 0.0 {
            return Ok(0.0);
        }
        let (counts, sums) = host.split_at(e);
        let dot: f64 = counts.iter().zip(sums).map(|(&c, &p)| f64::from(c) * f64::from(p)).sum();
        Ok(e as f64 * dot / (n * n))
    }

    /// The MoE MLP's forward: `moe(s.ln2)` into `s.m_pre` or `s.tmp_h` as `at.post_norm`
    /// says; weights from slab `w`.
    pub(super) fn moe_forward(
        &self,
        b: &B,
        w: &B::Floats,
        s: &mut LayerScratch<B>,
        at: MoeAt<'_, B>,
    ) -> Result<()> {
        let MoeAt { ranges: r, moe: m, tokens, post_norm: into_pre, router } = at;
        let stats = match router {
            RouterStats::Record(stats) => Some(stats),
            _ => None,
        };
        let shape = self.moe_shape(m, tokens);
        let (t, h, e, i) = (tokens, self.spec.hidden, m.experts, m.inter);
        let rows = shape.rows();
        let ln2 = b.view(&s.ln2, 0..t * h);
        let out = b.view_mut(if into_pre { &mut s.m_pre } else { &mut s.tmp_h }, 0..t * h);
        let x = s.moe.as_mut().ok_or_else(|| Error::invalid("layer scratch has no MoE buffers"))?;
        b.matmul_forward(
            b.view_mut(&mut x.logits, 0..t * e),
            Operands { inp: ln2, w: b.view(w, r.router_w.clone()) },
            &MatmulShape { rows: t, k: h, n: e },
        )?;
        if let Some(bias) = &r.router_b {
            b.bias_forward(b.view_mut(&mut x.logits, 0..t * e), b.view(w, bias.clone()), t, e)?;
        }
        b.moe_route(
            b.view_mut(&mut x.weights, 0..rows),
            b.view_mut(&mut x.probs, 0..t * e),
            &mut x.experts,
            b.view(&x.logits, 0..t * e),
            &shape,
        )?;
        if let Some(stats) = stats {
            b.moe_router_stats(
                b.view_mut(stats, 0..2 * e),
                b.view(&x.probs, 0..t * e),
                &x.experts,
                &shape,
            )?;
        }
        x.offsets = b.moe_sort(&mut x.order, &mut x.rows, &x.experts, &shape)?;
        b.moe_gather(b.view_mut(&mut x.xs, 0..rows * h), ln2, &x.order, &shape)?;
        let up = GroupedShape { offsets: &x.offsets, k: h, n: 2 * i, layout: m.layout };
        let down = GroupedShape { offsets: &x.offsets, k: i, n: h, layout: m.layout };
        b.grouped_matmul_forward(
            b.view_mut(&mut x.gate_up, 0..rows * 2 * i),
            Operands { inp: b.view(&x.xs, 0..rows * h), w: b.view(w, r.gate_up_w.clone()) },
            r.gate_up_b.as_ref().map(|bias| b.view(w, bias.clone())),
            &up,
        )?;
        b.glu_forward(
            b.view_mut(&mut x.act, 0..rows * i),
            b.view(&x.gate_up, 0..rows * 2 * i),
            rows,
            i,
            self.spec.glu_act,
        )?;
        b.grouped_matmul_forward(
            b.view_mut(&mut x.y, 0..rows * h),
            Operands { inp: b.view(&x.act, 0..rows * i), w: b.view(w, r.down_w.clone()) },
            r.down_b.as_ref().map(|bias| b.view(w, bias.clone())),
            &down,
        )?;
        b.moe_combine(
            out,
            b.view(&x.y, 0..rows * h),
            b.view(&x.weights, 0..rows),
            &x.rows,
            &shape,
        )?;
        let (Some(sr), Some(si)) = (&r.shared, m.shared_inter) else { return Ok(()) };
        // Qwen2MoeSparseMoeBlock: every token also goes through the shared expert, scaled by
        // its gate.
        let out = b.view_mut(if into_pre { &mut s.m_pre } else { &mut s.tmp_h }, 0..t * h);
        let ln2 = b.view(&s.ln2, 0..t * h);
        let x = s.moe.as_mut().ok_or_else(|| Error::invalid("layer scratch has no MoE buffers"))?;
        let wv = |range: &std::ops::Range<usize>| b.view(w, range.clone());
        b.matmul_forward(
            b.view_mut(&mut x.s_gate_up, 0..t * 2 * si),
            Operands { inp: ln2, w: wv(&sr.gate_up_w) },
            &MatmulShape { rows: t, k: h, n: 2 * si },
        )?;
        b.glu_forward(
            b.view_mut(&mut x.s_act, 0..t * si),
            b.view(&x.s_gate_up, 0..t * 2 * si),
            t,
            si,
            self.spec.glu_act,
        )?;
        b.matmul_forward(
            b.view_mut(&mut x.s_y, 0..t * h),
            Operands { inp: b.view(&x.s_act, 0..t * si), w: wv(&sr.down_w) },
            &MatmulShape { rows: t, k: si, n: h },
        )?;
        b.matmul_forward(
            b.view_mut(&mut x.s_logit, 0..t),
            Operands { inp: ln2, w: wv(&sr.gate_w) },
            &MatmulShape { rows: t, k: h, n: 1 },
        )?;
        b.sigmoid_gate_forward(out, b.view(&x.s_y, 0..t * h), b.view(&x.s_logit, 0..t), &shape)
    }

    /// The MoE MLP's backward after [`Decoder::moe_forward`] on the same scratch: the gradient
    /// of the MLP's output is `s.d_pre` or `dx_out` as `at.post_norm` says; the gradient of its
    /// input `s.ln2` goes to `s.tmp_h` (overwritten); weight gradients accumulate into `grad`.
    pub(super) fn moe_backward(
        &self,
        b: &B,
        grad: &mut B::Floats,
        dx_out: &B::Floats,
        w: &B::Floats,
        s: &mut LayerScratch<B>,
        at: MoeAt<'_, B>,
    ) -> Result<()> {
        let MoeAt { ranges: r, moe: m, tokens, post_norm: from_pre, router } = at;
        let aux = match router {
            RouterStats::Complete { stats, weight } if weight != 0.0 => Some((stats, weight)),
            _ => None,
        };
        let shape = self.moe_shape(m, tokens);
        let (t, h, e, i) = (tokens, self.spec.hidden, m.experts, m.inter);
        let rows = shape.rows();
        let ln2 = b.view(&s.ln2, 0..t * h);
        let d_out = b.view(if from_pre { &s.d_pre } else { dx_out }, 0..t * h);
        let d_in = &mut s.tmp_h;
        let x = s.moe.as_mut().ok_or_else(|| Error::invalid("layer scratch has no MoE buffers"))?;
        let up = GroupedShape { offsets: &x.offsets, k: h, n: 2 * i, layout: m.layout };
        let down = GroupedShape { offsets: &x.offsets, k: i, n: h, layout: m.layout };
        b.moe_combine_backward(
            Grads {
                dinp: b.view_mut(&mut x.d_y, 0..rows * h),
                dw: b.view_mut(&mut x.d_weights, 0..rows),
            },
            d_out,
            b.view(&x.y, 0..rows * h),
            b.view(&x.weights, 0..rows),
            &x.rows,
            &shape,
        )?;
        if let Some(bias) = &r.down_b {
            b.grouped_bias_backward(
                b.view_mut(grad, bias.clone()),
                b.view(&x.d_y, 0..rows * h),
                &down,
            )?;
        }
        b.grouped_matmul_backward(
            Grads {
                dinp: b.view_mut(&mut x.d_act, 0..rows * i),
                dw: b.view_mut(grad, r.down_w.clone()),
            },
            b.view(&x.d_y, 0..rows * h),
            Operands { inp: b.view(&x.act, 0..rows * i), w: b.view(w, r.down_w.clone()) },
            &down,
        )?;
        b.glu_backward(
            b.view_mut(&mut x.d_gate_up, 0..rows * 2 * i),
            b.view(&x.d_act, 0..rows * i),
            b.view(&x.gate_up, 0..rows * 2 * i),
            rows,
            i,
            self.spec.glu_act,
        )?;
        if let Some(bias) = &r.gate_up_b {
            let d = b.view(&x.d_gate_up, 0..rows * 2 * i);
            b.grouped_bias_backward(b.view_mut(grad, bias.clone()), d, &up)?;
        }
        b.grouped_matmul_backward(
            Grads {
                dinp: b.view_mut(&mut x.d_xs, 0..rows * h),
                dw: b.view_mut(grad, r.gate_up_w.clone()),
            },
            b.view(&x.d_gate_up, 0..rows * 2 * i),
            Operands { inp: b.view(&x.xs, 0..rows * h), w: b.view(w, r.gate_up_w.clone()) },
            &up,
        )?;
        b.moe_gather_backward(
            b.view_mut(d_in, 0..t * h),
            b.view(&x.d_xs, 0..rows * h),
            &x.rows,
            &shape,
        )?;
        // The router: its logits' gradient through the weights, plus the load-balancing term.
        let n = (t * m.sparse_layers()) as f32;
        let aux = aux.map(|(stats, weight)| (b.view(stats, 0..e), weight * e as f32 / (n * n)));
        b.moe_route_backward(
            b.view_mut(&mut x.d_logits, 0..t * e),
            b.view(&x.d_weights, 0..rows),
            Routing {
                weights: b.view(&x.weights, 0..rows),
                probs: b.view(&x.probs, 0..t * e),
                experts: &x.experts,
            },
            aux,
            &shape,
        )?;
        if let Some(bias) = &r.router_b {
            b.bias_backward(b.view_mut(grad, bias.clone()), b.view(&x.d_logits, 0..t * e), t, e)?;
        }
        // d_y is free again: it takes the router's share of the input gradient.
        b.matmul_backward(
            Grads {
                dinp: b.view_mut(&mut x.d_y, 0..t * h),
                dw: b.view_mut(grad, r.router_w.clone()),
            },
            b.view(&x.d_logits, 0..t * e),
            Operands { inp: ln2, w: b.view(w, r.router_w.clone()) },
            &MatmulShape { rows: t, k: h, n: e },
        )?;
        b.add_assign(b.view_mut(d_in, 0..t * h), b.view(&x.d_y, 0..t * h))?;
        let (Some(sr), Some(si)) = (&r.shared, m.shared_inter) else { return Ok(()) };
        // The shared expert and its gate, each adding its share of the input's gradient.
        let wv = |range: &std::ops::Range<usize>| b.view(w, range.clone());
        b.sigmoid_gate_backward(
            b.view_mut(&mut x.d_s_y, 0..t * h),
            b.view_mut(&mut x.d_s_logit, 0..t),
            d_out,
            b.view(&x.s_y, 0..t * h),
            b.view(&x.s_logit, 0..t),
            &shape,
        )?;
        b.matmul_backward(
            Grads {
                dinp: b.view_mut(&mut x.d_s_act, 0..t * si),
                dw: b.view_mut(grad, sr.down_w.clone()),
            },
            b.view(&x.d_s_y, 0..t * h),
            Operands { inp: b.view(&x.s_act, 0..t * si), w: wv(&sr.down_w) },
            &MatmulShape { rows: t, k: si, n: h },
        )?;
        b.glu_backward(
            b.view_mut(&mut x.d_s_gate_up, 0..t * 2 * si),
            b.view(&x.d_s_act, 0..t * si),
            b.view(&x.s_gate_up, 0..t * 2 * si),
            t,
            si,
            self.spec.glu_act,
        )?;
        b.matmul_backward(
            Grads {
                dinp: b.view_mut(&mut x.d_y, 0..t * h),
                dw: b.view_mut(grad, sr.gate_up_w.clone()),
            },
            b.view(&x.d_s_gate_up, 0..t * 2 * si),
            Operands { inp: ln2, w: wv(&sr.gate_up_w) },
            &MatmulShape { rows: t, k: h, n: 2 * si },
        )?;
        b.add_assign(b.view_mut(d_in, 0..t * h), b.view(&x.d_y, 0..t * h))?;
        b.matmul_backward(
            Grads {
                dinp: b.view_mut(&mut x.d_y, 0..t * h),
                dw: b.view_mut(grad, sr.gate_w.clone()),
            },
            b.view(&x.d_s_logit, 0..t),
            Operands { inp: ln2, w: wv(&sr.gate_w) },
            &MatmulShape { rows: t, k: h, n: 1 },
        )?;
        b.add_assign(b.view_mut(d_in, 0..t * h), b.view(&x.d_y, 0..t * h))
    }
}
