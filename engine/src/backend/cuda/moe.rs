//! A mixture-of-experts MLP: routing, the sort of (token, slot) pairs by expert, gather and
//! combine (`kernels/moe.cu`), and the experts' GEMMs; the CPU twin with the derivations is
//! `backend/cpu/moe.rs`.
//!
//! The experts' GEMMs are one product per expert that has rows, each on a contiguous block of
//! the sorted rows with its own matrix, handed together to `Cuda::gemm_group`: one cuBLASLt
//! GEMM per expert, as `matmul` runs them, or, with `Cuda::set_grouped_gemm` on, one cuBLAS
//! `cublasGemmGroupedBatchedEx` for all of them (one group of one GEMM per expert) where its
//! output is bf16 and every operand 16-byte aligned (the forward and the input gradient of real
//! models; the weight gradients accumulate into f32 from bf16 operands, a combination the
//! grouped GEMM does not offer). The loop is the default: it measured faster on the H200 (see
//! `Cuda::set_grouped_gemm`).
//!
//! The int buffers these ops write on the device (experts, order, rows) have no host copy of
//! their contents: ops reading them check only their length, and every kernel bounds the
//! indices it reads. `moe_sort` reads its counts back anyway (the offsets are the host's), so
//! it is where ids outside `0..E` are refused.

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::device::{base_ptr, drv, grid_1d, scratch};
use super::kernel;
use super::matmul::GemmCall;
use super::profile::OpClass;
use super::{Cuda, Ints, View, ViewMut, check};
use crate::backend::{
    ExpertLayout, FloatKind, Grads, GroupedShape, MoeOps, MoeShape, Operands, RouterKind, Routing,
};
use crate::error::Result;

/// Pairs per chunk of the sort's counting passes; one warp walks a chunk in the scatter.
const SORT_CHUNK: usize = 512;

/// Warps per block of the kernels that give each token or pair one warp.
const WARPS: usize = 8;

/// Most experts a layer may have: the sort keeps a count per expert in shared memory.
const MAX_EXPERTS: usize = 4096;

/// A launch of one warp per row.
fn warp_rows(op: &str, rows: usize) -> Result<LaunchConfig> {
    let blocks = check::int(op, "blocks", rows.div_ceil(WARPS))?;
    Ok(LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (32 * WARPS as u32, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// Checks a MoE shape as the CPU twin does, and that its sizes fit the kernels' ints; returns
/// the number of pairs, `T k`.
fn moe_shape(op: &str, shape: &MoeShape) -> Result<usize> {
    check::nonzero(op, "experts", shape.experts)?;
    if shape.top_k == 0 || shape.top_k > shape.experts {
        return Err(check::err(
            op,
            format!("top_k {} must be in 1..={} (the experts)", shape.top_k, shape.experts),
        ));
    }
    if shape.experts > MAX_EXPERTS {
        return Err(check::err(
            op,
            format!("{} experts exceed the most supported, {MAX_EXPERTS}", shape.experts),
        ));
    }
    let pairs = shape
        .tokens
        .checked_mul(shape.top_k)
        .ok_or_else(|| check::err(op, "tokens x top_k overflows"))?;
    check::int(op, "tokens x top_k", pairs)?;
    Ok(pairs)
}

/// The kernels' code for a router (`ROUTER_*` in moe.cu).
fn router_id(r: RouterKind) -> i32 {
    match r {
        RouterKind::SoftmaxTopK { renormalize: false } => 0,
        RouterKind::SoftmaxTopK { renormalize: true } => 1,
        RouterKind::TopKSoftmax => 2,
    }
}

/// Checks the offsets of a grouped GEMM as the CPU twin does.
fn grouped_shape(op: &str, g: &GroupedShape<'_>) -> Result<()> {
    check::nonzero(op, "experts", g.experts())?;
    if g.offsets[0] != 0 || g.offsets.windows(2).any(|w| w[1] < w[0]) {
        return Err(check::err(op, "offsets must start at 0 and never decrease"));
    }
    Ok(())
}

/// Elements `start..start + len` of a view (the caller checked the view holds them).
fn part<'a>(v: &View<'a>, start: usize, len: usize) -> View<'a> {
    View { buf: v.buf, start: v.start + start, len }
}

impl Cuda {
    /// Pairs per expert in each chunk of `SORT_CHUNK` pairs: `[chunks, E + 1]`, the last column
    /// counting ids outside `0..E`. Returns the counts and the number of chunks.
    fn count_pairs(
        &self,
        op: &str,
        experts: &Ints,
        pairs: usize,
        e: usize,
    ) -> Result<(CudaSlice<i32>, usize)> {
        let chunks = pairs.div_ceil(SORT_CHUNK);
        let counts = scratch::<i32>(&self.compute, chunks * (e + 1))?;
        self.launch(
            LaunchConfig {
                grid_dim: (check::int(op, "chunks", chunks)? as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: (4 * (e + 1)) as u32,
            },
            kernel::moe_count {
                counts: base_ptr(&counts, &self.compute),
                experts: self.ints_ptr(experts),
                pairs: pairs as i64,
                E: e as i32,
                chunk: SORT_CHUNK as i64,
            },
        )?;
        Ok((counts, chunks))
    }
}

impl MoeOps for Cuda {
    fn moe_route(
        &self,
        weights: ViewMut<'_>,
        probs: ViewMut<'_>,
        experts: &mut Ints,
        logits: View<'_>,
        shape: &MoeShape,
    ) -> Result<()> {
        let _t = self.timed("moe_route", OpClass::Routing, 0.0);
        const OP: &str = "moe_route";
        let pairs = moe_shape(OP, shape)?;
        let (t, e, k) = (shape.tokens, shape.experts, shape.top_k);
        let (w, p) = (weights.as_view(), probs.as_view());
        check::len(OP, "weights", w.len, &[t, k])?;
        check::len(OP, "probs", p.len, &[t, e])?;
        check::len(OP, "logits", logits.len, &[t, e])?;
        check::kind(OP, "weights", &w, FloatKind::Accum)?;
        check::kind(OP, "probs", &p, FloatKind::Accum)?;
        check::ints(OP, "experts", &experts.host, pairs)?;
        self.launch(
            warp_rows(OP, t)?,
            kernel::moe_route {
                weights: self.ptr(&w),
                probs: self.ptr(&p),
                experts: self.ints_ptr(experts),
                logits: self.ptr(&logits),
                z_f32: logits.is_f32(),
                tokens: t as i64,
                E: e as i32,
                k: k as i32,
                router: router_id(shape.router),
            },
        )
    }

    fn moe_route_backward(
        &self,
        dlogits: ViewMut<'_>,
        dweights: View<'_>,
        routing: Routing<View<'_>, &Ints>,
        aux: Option<(View<'_>, f32)>,
        shape: &MoeShape,
    ) -> Result<()> {
        let _t = self.timed("moe_route_backward", OpClass::Routing, 0.0);
        const OP: &str = "moe_route_backward";
        let Routing { weights, probs, experts } = routing;
        let pairs = moe_shape(OP, shape)?;
        let (t, e, k) = (shape.tokens, shape.experts, shape.top_k);
        let dz = dlogits.as_view();
        check::len(OP, "dlogits", dz.len, &[t, e])?;
        check::len(OP, "dweights", dweights.len, &[t, k])?;
        check::len(OP, "weights", weights.len, &[t, k])?;
        check::len(OP, "probs", probs.len, &[t, e])?;
        check::kind(OP, "weights", &weights, FloatKind::Accum)?;
        check::kind(OP, "probs", &probs, FloatKind::Accum)?;
        check::ints(OP, "experts", &experts.host, pairs)?;
        if let Some((counts, _)) = &aux {
            check::len(OP, "counts", counts.len, &[e])?;
            check::kind(OP, "counts", counts, FloatKind::Accum)?;
        }
        let (counts, scale) = aux.map_or((0, 0.0), |(c, s)| (self.ptr(&c), s));
        self.launch(
            warp_rows(OP, t)?,
            kernel::moe_route_backward {
                dlogits: self.ptr(&dz),
                dz_f32: dz.is_f32(),
                dweights: self.ptr(&dweights),
                dw_f32: dweights.is_f32(),
                weights: self.ptr(&weights),
                probs: self.ptr(&probs),
                experts: self.ints_ptr(experts),
                // A null pointer: no load-balancing term.
                counts,
                aux_scale: scale,
                tokens: t as i64,
                E: e as i32,
                k: k as i32,
                router: router_id(shape.router),
            },
        )
    }

    /// The counts as the CPU twin forms them, added to `stats[..E]`; the summed probabilities
    /// through the deterministic column sum. Ids outside `0..E` are not counted (checking them
    /// would wait for the device; `moe_sort` refuses them).
    fn moe_router_stats(
        &self,
        stats: ViewMut<'_>,
        probs: View<'_>,
        experts: &Ints,
        shape: &MoeShape,
    ) -> Result<()> {
        let _t = self.timed("moe_router_stats", OpClass::Routing, 0.0);
        const OP: &str = "moe_router_stats";
        let pairs = moe_shape(OP, shape)?;
        let (t, e) = (shape.tokens, shape.experts);
        check::len(OP, "stats", stats.len, &[2, e])?;
        check::len(OP, "probs", probs.len, &[t, e])?;
        check::ints(OP, "experts", &experts.host, pairs)?;
        if t == 0 {
            return Ok(());
        }
        let s = stats.as_view();
        let (counts, chunks) = self.count_pairs(OP, experts, pairs, e)?;
        self.launch(
            grid_1d(e),
            kernel::moe_count_stats {
                stats: self.ptr(&s),
                stats_f32: s.is_f32(),
                counts: base_ptr(&counts, &self.compute),
                chunks: chunks as i32,
                E: e as i32,
            },
        )?;
        let ViewMut { buf, start, .. } = stats;
        let sums = ViewMut { buf, start: start + e, len: e };
        self.column_sum(&sums, &probs, t, e)
    }

    /// A stable counting sort on the device: chunk counts, their scan into offsets and per-chunk
    /// starts, and a scatter in pair order; then the offsets come back to the host. An id
    /// outside `0..E` is found only there, after `order` and `rows` were written in part.
    fn moe_sort(
        &self,
        order: &mut Ints,
        rows: &mut Ints,
        experts: &Ints,
        shape: &MoeShape,
    ) -> Result<Vec<usize>> {
        let _t = self.timed("moe_sort", OpClass::Routing, 0.0);
        const OP: &str = "moe_sort";
        let pairs = moe_shape(OP, shape)?;
        let e = shape.experts;
        check::ints(OP, "experts", &experts.host, pairs)?;
        check::ints(OP, "order", &order.host, pairs)?;
        check::ints(OP, "rows", &rows.host, pairs)?;
        if pairs == 0 {
            return Ok(vec![0; e + 1]);
        }
        let (counts, chunks) = self.count_pairs(OP, experts, pairs, e)?;
        let offsets = scratch::<i32>(&self.compute, e + 2)?;
        let base = scratch::<i32>(&self.compute, chunks * e)?;
        let (op, bp) = (base_ptr(&offsets, &self.compute), base_ptr(&base, &self.compute));
        self.launch(
            LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: (4 * (e + 1)) as u32,
            },
            kernel::moe_sort_bounds {
                offsets: op,
                base: bp,
                counts: base_ptr(&counts, &self.compute),
                chunks: chunks as i32,
                E: e as i32,
            },
        )?;
        self.launch(
            LaunchConfig {
                grid_dim: (chunks as u32, 1, 1),
                block_dim: (32, 1, 1),
                shared_mem_bytes: (4 * e) as u32,
            },
            kernel::moe_sort_scatter {
                order: self.ints_ptr(order),
                rows: self.ints_ptr(rows),
                experts: self.ints_ptr(experts),
                base: bp,
                pairs: pairs as i64,
                E: e as i32,
                chunk: SORT_CHUNK as i64,
            },
        )?;
        // Into pageable memory: returns once the copy (and so the sort before it) is done.
        let host = drv(OP, self.compute.clone_dtoh(&offsets))?;
        if host[e + 1] != 0 {
            return Err(check::err(
                OP,
                format!(
                    "{} of the {pairs} expert ids are outside 0..{e}; order and rows are \
                     incomplete",
                    host[e + 1]
                ),
            ));
        }
        Ok(host[..=e].iter().map(|&o| o as usize).collect())
    }

    fn moe_gather(
        &self,
        xs: ViewMut<'_>,
        x: View<'_>,
        order: &Ints,
        shape: &MoeShape,
    ) -> Result<()> {
        let _t = self.timed("moe_gather", OpClass::Routing, 0.0);
        const OP: &str = "moe_gather";
        let pairs = moe_shape(OP, shape)?;
        let (t, h) = (shape.tokens, shape.hidden);
        let o = xs.as_view();
        check::len(OP, "xs", o.len, &[pairs, h])?;
        check::len(OP, "x", x.len, &[t, h])?;
        check::ints(OP, "order", &order.host, pairs)?;
        self.launch(
            grid_1d(o.len),
            kernel::moe_gather {
                xs: self.ptr(&o),
                xs_f32: o.is_f32(),
                x: self.ptr(&x),
                x_f32: x.is_f32(),
                order: self.ints_ptr(order),
                pairs: pairs as i64,
                hidden: h as i64,
                k: shape.top_k as i32,
            },
        )
    }

    fn moe_gather_backward(
        &self,
        dx: ViewMut<'_>,
        dxs: View<'_>,
        rows: &Ints,
        shape: &MoeShape,
    ) -> Result<()> {
        let _t = self.timed("moe_gather_backward", OpClass::Routing, 0.0);
        const OP: &str = "moe_gather_backward";
        let pairs = moe_shape(OP, shape)?;
        let (t, h) = (shape.tokens, shape.hidden);
        let d = dx.as_view();
        check::len(OP, "dx", d.len, &[t, h])?;
        check::len(OP, "dxs", dxs.len, &[pairs, h])?;
        check::ints(OP, "rows", &rows.host, pairs)?;
        self.launch(
            grid_1d(d.len),
            kernel::moe_gather_backward {
                dx: self.ptr(&d),
                dx_f32: d.is_f32(),
                dxs: self.ptr(&dxs),
                dxs_f32: dxs.is_f32(),
                rows: self.ints_ptr(rows),
                tokens: t as i64,
                pairs: pairs as i64,
                hidden: h as i64,
                k: shape.top_k as i32,
            },
        )
    }

    fn moe_combine(
        &self,
        out: ViewMut<'_>,
        y: View<'_>,
        weights: View<'_>,
        rows: &Ints,
        shape: &MoeShape,
    ) -> Result<()> {
        let _t = self.timed("moe_combine", OpClass::Routing, 0.0);
        const OP: &str = "moe_combine";
        let pairs = moe_shape(OP, shape)?;
        let (t, h, k) = (shape.tokens, shape.hidden, shape.top_k);
        let o = out.as_view();
        check::len(OP, "out", o.len, &[t, h])?;
        check::len(OP, "y", y.len, &[pairs, h])?;
        check::len(OP, "weights", weights.len, &[t, k])?;
        check::kind(OP, "weights", &weights, FloatKind::Accum)?;
        check::ints(OP, "rows", &rows.host, pairs)?;
        self.launch(
            grid_1d(o.len),
            kernel::moe_combine {
                out: self.ptr(&o),
                out_f32: o.is_f32(),
                y: self.ptr(&y),
                y_f32: y.is_f32(),
                weights: self.ptr(&weights),
                rows: self.ints_ptr(rows),
                tokens: t as i64,
                pairs: pairs as i64,
                hidden: h as i64,
                k: k as i32,
            },
        )
    }

    fn moe_combine_backward(
        &self,
        grads: Grads<ViewMut<'_>>,
        dout: View<'_>,
        y: View<'_>,
        weights: View<'_>,
        rows: &Ints,
        shape: &MoeShape,
    ) -> Result<()> {
        let _t = self.timed("moe_combine_backward", OpClass::Routing, 0.0);
        const OP: &str = "moe_combine_backward";
        let pairs = moe_shape(OP, shape)?;
        let (t, h, k) = (shape.tokens, shape.hidden, shape.top_k);
        let (d, dw) = (grads.dinp.as_view(), grads.dw.as_view());
        check::len(OP, "dy", d.len, &[pairs, h])?;
        check::len(OP, "dweights", dw.len, &[t, k])?;
        check::len(OP, "dout", dout.len, &[t, h])?;
        check::len(OP, "y", y.len, &[pairs, h])?;
        check::len(OP, "weights", weights.len, &[t, k])?;
        check::kind(OP, "dweights", &dw, FloatKind::Accum)?;
        check::kind(OP, "weights", &weights, FloatKind::Accum)?;
        check::ints(OP, "rows", &rows.host, pairs)?;
        self.launch(
            grid_1d(d.len),
            kernel::moe_combine_backward_dy {
                dy: self.ptr(&d),
                dy_f32: d.is_f32(),
                dout: self.ptr(&dout),
                dout_f32: dout.is_f32(),
                weights: self.ptr(&weights),
                rows: self.ints_ptr(rows),
                pairs: pairs as i64,
                hidden: h as i64,
                k: k as i32,
            },
        )?;
        self.launch(
            warp_rows(OP, pairs)?,
            kernel::moe_combine_backward_dw {
                dweights: self.ptr(&dw),
                dout: self.ptr(&dout),
                dout_f32: dout.is_f32(),
                y: self.ptr(&y),
                y_f32: y.is_f32(),
                rows: self.ints_ptr(rows),
                pairs: pairs as i64,
                hidden: h as i64,
                k: k as i32,
            },
        )
    }

    fn sigmoid_gate_forward(
        &self,
        out: ViewMut<'_>,
        y: View<'_>,
        logits: View<'_>,
        shape: &MoeShape,
    ) -> Result<()> {
        let _t = self.timed("sigmoid_gate_forward", OpClass::Activation, 0.0);
        const OP: &str = "sigmoid_gate_forward";
        let (rows, n) = (shape.tokens, shape.hidden);
        let o = out.as_view();
        check::len(OP, "out", o.len, &[rows, n])?;
        check::len(OP, "y", y.len, &[rows, n])?;
        check::len(OP, "logits", logits.len, &[rows])?;
        check::kind(OP, "logits", &logits, FloatKind::Accum)?;
        if o.len == 0 {
            return Ok(());
        }
        self.launch(
            grid_1d(o.len),
            kernel::sigmoid_gate_forward {
                out: self.ptr(&o),
                out_f32: o.is_f32(),
                y: self.ptr(&y),
                y_f32: y.is_f32(),
                logits: self.ptr(&logits),
                rows: rows as i64,
                n: n as i64,
            },
        )
    }

    fn sigmoid_gate_backward(
        &self,
        dy: ViewMut<'_>,
        dlogits: ViewMut<'_>,
        dout: View<'_>,
        y: View<'_>,
        logits: View<'_>,
        shape: &MoeShape,
    ) -> Result<()> {
        let _t = self.timed("sigmoid_gate_backward", OpClass::Activation, 0.0);
        const OP: &str = "sigmoid_gate_backward";
        let (rows, n) = (shape.tokens, shape.hidden);
        let (d, dz) = (dy.as_view(), dlogits.as_view());
        check::len(OP, "dy", d.len, &[rows, n])?;
        check::len(OP, "dlogits", dz.len, &[rows])?;
        check::len(OP, "dout", dout.len, &[rows, n])?;
        check::len(OP, "y", y.len, &[rows, n])?;
        check::len(OP, "logits", logits.len, &[rows])?;
        check::kind(OP, "logits", &logits, FloatKind::Accum)?;
        if rows == 0 {
            return Ok(());
        }
        self.launch(
            warp_rows(OP, rows)?,
            kernel::sigmoid_gate_backward {
                dy: self.ptr(&d),
                dy_f32: d.is_f32(),
                dlogits: self.ptr(&dz),
                dlogits_f32: dz.is_f32(),
                dout: self.ptr(&dout),
                dout_f32: dout.is_f32(),
                y: self.ptr(&y),
                y_f32: y.is_f32(),
                logits: self.ptr(&logits),
                rows: rows as i64,
                n: n as i64,
            },
        )
    }

    /// One GEMM per expert with rows, run together by `gemm_group`; the mapping of each layout
    /// to cuBLAS's column-major product is `matmul`'s, and for `Cols` (`w_e [K, N]`,
    /// out = inp · w_e):
    /// `outᵀ[N, m] = w_e (stored N x K, ld N) · inpᵀ`.
    fn grouped_matmul_forward(
        &self,
        out: ViewMut<'_>,
        operands: Operands<View<'_>>,
        bias: Option<View<'_>>,
        g: &GroupedShape<'_>,
    ) -> Result<()> {
        let _t = self.timed(
            "grouped_matmul_forward",
            OpClass::Gemm,
            2.0 * (g.rows() * g.k * g.n) as f64,
        );
        const OP: &str = "grouped_matmul_forward";
        let Operands { inp, w } = operands;
        grouped_shape(OP, g)?;
        let (r, k, n, e) = (g.rows(), g.k, g.n, g.experts());
        let o = out.as_view();
        check::len(OP, "out", o.len, &[r, n])?;
        check::len(OP, "inp", inp.len, &[r, k])?;
        check::len(OP, "w", w.len, &[e, n, k])?;
        if let Some(b) = &bias {
            check::len(OP, "bias", b.len, &[e, n])?;
        }
        check::int(OP, "rows", r)?;
        let mut calls = Vec::with_capacity(e);
        for x in 0..e {
            let (r0, m) = (g.offsets[x], g.offsets[x + 1] - g.offsets[x]);
            if m == 0 {
                continue;
            }
            let (oe, ie, we) =
                (part(&o, r0 * n, m * n), part(&inp, r0 * k, m * k), part(&w, x * n * k, n * k));
            let (trans_w, ldw) = match g.layout {
                ExpertLayout::Rows => (true, k),
                ExpertLayout::Cols => (false, n),
            };
            calls.push(GemmCall {
                trans: (trans_w, false),
                dims: (n, m, k),
                a: (we, ldw),
                b: (ie, k),
                c: (oe, n),
                accumulate: false,
            });
        }
        self.gemm_group(OP, &calls)?;
        let Some(bias) = bias else { return Ok(()) };
        if r == 0 || n == 0 {
            return Ok(());
        }
        // Each row finds its expert in the offsets (a binary search), so one launch adds every
        // expert's bias.
        let offsets: Vec<i32> = g.offsets.iter().map(|&v| v as i32).collect();
        self.bind()?;
        let offsets = drv(OP, self.compute.clone_htod(&offsets))?;
        self.launch(
            grid_1d(o.len),
            kernel::grouped_bias_forward {
                out: self.ptr(&o),
                out_f32: o.is_f32(),
                bias: self.ptr(&bias),
                bias_f32: bias.is_f32(),
                offsets: base_ptr(&offsets, &self.compute),
                E: check::int(OP, "experts", e)?,
                rows: r as i64,
                n: n as i64,
            },
        )
        // The offsets were copied from pageable memory; the device copy lives until the kernel
        // has run (freed in stream order when dropped).
    }

    /// Per expert with rows, `matmul_backward`'s two GEMMs, the experts' input gradients run
    /// together by `gemm_group` and then their weight gradients; for `Cols`:
    /// `dinpᵀ[K, m] = op(w_e stored N x K, transposed) · doutᵀ` and
    /// `dw_eᵀ[N, K] += doutᵀ · inp` (beta = 1 into the f32 accumulator).
    fn grouped_matmul_backward(
        &self,
        grads: Grads<ViewMut<'_>>,
        dout: View<'_>,
        operands: Operands<View<'_>>,
        g: &GroupedShape<'_>,
    ) -> Result<()> {
        let _t = self.timed(
            "grouped_matmul_backward",
            OpClass::Gemm,
            4.0 * (g.rows() * g.k * g.n) as f64,
        );
        const OP: &str = "grouped_matmul_backward";
        let Operands { inp, w } = operands;
        grouped_shape(OP, g)?;
        let (r, k, n, e) = (g.rows(), g.k, g.n, g.experts());
        let (di, dwv) = (grads.dinp.as_view(), grads.dw.as_view());
        check::len(OP, "dinp", di.len, &[r, k])?;
        check::len(OP, "dw", dwv.len, &[e, n, k])?;
        check::len(OP, "dout", dout.len, &[r, n])?;
        check::len(OP, "inp", inp.len, &[r, k])?;
        check::len(OP, "w", w.len, &[e, n, k])?;
        let (mut dinp_calls, mut dw_calls) = (Vec::with_capacity(e), Vec::with_capacity(e));
        for x in 0..e {
            let (r0, m) = (g.offsets[x], g.offsets[x + 1] - g.offsets[x]);
            if m == 0 {
                // No rows: no input gradient to write, and nothing to add to dw_e.
                continue;
            }
            let (die, de, ie) =
                (part(&di, r0 * k, m * k), part(&dout, r0 * n, m * n), part(&inp, r0 * k, m * k));
            let (we, dwe) = (part(&w, x * n * k, n * k), part(&dwv, x * n * k, n * k));
            let call =
                |trans, dims, a, b, c, accumulate| GemmCall { trans, dims, a, b, c, accumulate };
            let (dinp_call, dw_call) = match g.layout {
                ExpertLayout::Rows => (
                    call((false, false), (k, m, n), (we, k), (de, n), (die, k), false),
                    call((false, true), (k, n, m), (ie, k), (de, n), (dwe, k), true),
                ),
                ExpertLayout::Cols => (
                    call((true, false), (k, m, n), (we, n), (de, n), (die, k), false),
                    call((false, true), (n, k, m), (de, n), (ie, k), (dwe, n), true),
                ),
            };
            dinp_calls.push(dinp_call);
            dw_calls.push(dw_call);
        }
        // The input gradients (bf16) may go as one grouped cuBLAS call; the weight gradients, f32
        // accumulators, stay one cuBLASLt GEMM per expert inside `gemm_group` (the grouped GEMM
        // has no bf16-in, f32-out form).
        self.gemm_group(OP, &dinp_calls)?;
        self.gemm_group(OP, &dw_calls)
    }

    /// The column sums of each expert's rows, by the deterministic `column_sum`.
    fn grouped_bias_backward(
        &self,
        dbias: ViewMut<'_>,
        dout: View<'_>,
        g: &GroupedShape<'_>,
    ) -> Result<()> {
        let _t = self.timed("grouped_bias_backward", OpClass::Elementwise, 0.0);
        const OP: &str = "grouped_bias_backward";
        grouped_shape(OP, g)?;
        let (r, n, e) = (g.rows(), g.n, g.experts());
        check::len(OP, "dbias", dbias.len, &[e, n])?;
        check::len(OP, "dout", dout.len, &[r, n])?;
        let ViewMut { buf, start, .. } = dbias;
        for x in 0..e {
            let (r0, m) = (g.offsets[x], g.offsets[x + 1] - g.offsets[x]);
            let db = ViewMut { buf: &mut *buf, start: start + x * n, len: n };
            self.column_sum(&db, &part(&dout, r0 * n, m * n), m, n)?;
        }
        Ok(())
    }
}
