//! Residual additions, reductions, bias, the gated MLP's activations (GPT-OSS's clamped SwiGLU
//! included), RoPE and the embedding: the CPU twins are in
//! `backend/cpu/{elementwise,matmul,mlp,rope,embedding}.rs`.

use cudarc::driver::LaunchConfig;

use super::device::{base_ptr, drv, grid_1d, scratch};
use super::kernel;
use super::profile::OpClass;
use super::{Cuda, Ints, View, ViewMut, check};
use crate::backend::{AttentionShape, ElementwiseOps, FloatKind, GluAct};
use crate::error::Result;

/// Elements per partial sum of `sum`/`sum_squares`: fixed, so the result does not depend on the
/// GPU's size.
const SUM_CHUNK: usize = 1 << 16;

/// Row chunks of a column reduction: at most this many partial rows, then one ordered pass.
pub(super) const COLUMN_CHUNKS: usize = 256;

/// Threads per block of `glu_forward_vec` and `glu_backward_vec`, one 16-byte vector each.
const GLU_VEC_THREADS: usize = 128;

/// Whether a buffer of this precision starting at this device address can be read and written
/// as 16-byte vectors of 8 bf16, as the `_vec` kernels do (the callers also check that every row
/// is a whole number of vectors).
fn bf16_vectors(kind: FloatKind, ptr: u64) -> bool {
    kind == FloatKind::Activation && ptr.is_multiple_of(16)
}

impl Cuda {
    /// `bf16_vectors` for every view.
    pub(super) fn vectors(&self, views: &[&View<'_>]) -> bool {
        views.iter().all(|v| bf16_vectors(v.kind(), self.ptr(v)))
    }

    /// `Σ src` or `Σ src²`: one f64 partial per fixed chunk on the device, added in chunk order
    /// on the host.
    pub(super) fn reduce(&self, op: &str, src: View<'_>, squares: bool) -> Result<f64> {
        if src.len == 0 {
            return Ok(0.0);
        }
        let chunks = src.len.div_ceil(SUM_CHUNK);
        let partials = scratch::<f64>(&self.compute, chunks)?;
        self.launch(
            LaunchConfig {
                grid_dim: (chunks as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            },
            kernel::sum_partials {
                partials: base_ptr(&partials, &self.compute),
                src: self.ptr(&src),
                src_f32: src.is_f32(),
                n: src.len as i64,
                chunk: SUM_CHUNK as i64,
                squares: i32::from(squares),
            },
        )?;
        let host = drv(op, self.compute.clone_dtoh(&partials))?;
        Ok(host.iter().sum())
    }

    /// `dst[j] += Σ_r src[r, j]` in a fixed order: partial sums over row chunks, then one pass
    /// that adds the chunks in order. dst `[n]`, src `[rows, n]`.
    pub(super) fn column_sum(
        &self,
        dst: &ViewMut<'_>,
        src: &View<'_>,
        rows: usize,
        n: usize,
    ) -> Result<()> {
        if rows == 0 || n == 0 {
            return Ok(());
        }
        let rows_per = rows.div_ceil(COLUMN_CHUNKS.min(rows));
        let chunks = rows.div_ceil(rows_per);
        let partials = scratch::<f32>(&self.compute, chunks * n)?;
        let pp = base_ptr(&partials, &self.compute);
        self.launch(
            LaunchConfig {
                grid_dim: (n.div_ceil(256) as u32, chunks as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            },
            kernel::colsum_partials {
                partials: pp,
                src: self.ptr(src),
                src_f32: src.is_f32(),
                rows: rows as i64,
                n: n as i64,
                rows_per: rows_per as i64,
            },
        )?;
        self.finish_columns(dst, pp, chunks, n)
    }

    /// `dst[j] += Σ_c partials[c, j]`, chunks in order. partials `[chunks, n]` (f32).
    pub(super) fn finish_columns(
        &self,
        dst: &ViewMut<'_>,
        partials: cudarc::driver::sys::CUdeviceptr,
        chunks: usize,
        n: usize,
    ) -> Result<()> {
        let d = dst.as_view();
        // One thread per column with a serial loop over the chunks: small blocks spread the few
        // columns over more SMs.
        let threads = 64;
        self.launch(
            LaunchConfig {
                grid_dim: (n.div_ceil(threads).min(1 << 20) as u32, 1, 1),
                block_dim: (threads as u32, 1, 1),
                shared_mem_bytes: 0,
            },
            kernel::colsum_finish {
                dst: self.ptr(&d),
                dst_f32: d.is_f32(),
                partials,
                chunks: chunks as i64,
                n: n as i64,
            },
        )
    }

    /// RoPE by `+θ` (`sign` 1, `rope_forward`) or its transpose (`sign` -1, `rope_backward`).
    fn rope(
        &self,
        qkv: ViewMut<'_>,
        pos: &Ints,
        inv_freq: View<'_>,
        scale: f32,
        shape: &AttentionShape,
        sign: f32,
    ) -> Result<()> {
        let op = if sign > 0.0 { "rope_forward" } else { "rope_backward" };
        let width = check::attention_shape(op, shape)?;
        let hd = shape.head_dim;
        if !hd.is_multiple_of(2) {
            return Err(check::err(op, format!("head_dim {hd} must be even for rotary embedding")));
        }
        let half = inv_freq.len;
        if half == 0 || 2 * half > hd {
            return Err(check::err(
                op,
                format!("`inv_freq` has {half} frequencies; a head of {hd} takes 1 to {}", hd / 2),
            ));
        }
        check::len(op, "qkv", qkv.len, &[shape.tokens, width])?;
        check::ints(op, "pos", &pos.host, shape.tokens)?;
        let heads = shape.q_heads + shape.kv_heads;
        let q = qkv.as_view();
        // rope_vec's cos/sin table holds 256 frequencies.
        if hd.is_multiple_of(8) && half.is_multiple_of(8) && half <= 256 && self.vectors(&[&q]) {
            let threads = (heads * half / 8).next_multiple_of(32).min(256);
            return self.launch(
                LaunchConfig {
                    grid_dim: (check::int(op, "tokens", shape.tokens)? as u32, 1, 1),
                    block_dim: (threads as u32, 1, 1),
                    shared_mem_bytes: 0,
                },
                kernel::rope_vec {
                    qkv: self.ptr(&q),
                    pos: self.ints_ptr(pos),
                    inv_freq: self.ptr(&inv_freq),
                    freq_f32: inv_freq.is_f32(),
                    width: width as i64,
                    heads: check::int(op, "heads", heads)?,
                    hd: check::int(op, "head_dim", hd)?,
                    half: check::int(op, "half", half)?,
                    scale,
                    sign,
                },
            );
        }
        self.launch(
            grid_1d(shape.tokens * heads * half),
            kernel::rope {
                qkv: self.ptr(&q),
                qkv_f32: q.is_f32(),
                pos: self.ints_ptr(pos),
                inv_freq: self.ptr(&inv_freq),
                freq_f32: inv_freq.is_f32(),
                tokens: shape.tokens as i64,
                width: width as i64,
                heads: check::int(op, "heads", heads)?,
                hd: check::int(op, "head_dim", hd)?,
                half: check::int(op, "half", half)?,
                scale,
                sign,
            },
        )
    }
}

impl ElementwiseOps for Cuda {
    fn fill_zero(&self, dst: ViewMut<'_>) -> Result<()> {
        let _t = self.timed("fill_zero", OpClass::Elementwise, 0.0);
        self.zero(&dst)
    }

    fn copy(&self, dst: ViewMut<'_>, src: View<'_>) -> Result<()> {
        let _t = self.timed("copy", OpClass::Elementwise, 0.0);
        self.copy_floats(dst, src)
    }

    fn add(&self, out: ViewMut<'_>, a: View<'_>, b: View<'_>) -> Result<()> {
        let _t = self.timed("add", OpClass::Elementwise, 0.0);
        check::len("add", "a", a.len, &[out.len])?;
        check::len("add", "b", b.len, &[out.len])?;
        let o = out.as_view();
        self.launch(
            grid_1d(o.len),
            kernel::add {
                out: self.ptr(&o),
                out_f32: o.is_f32(),
                a: self.ptr(&a),
                a_f32: a.is_f32(),
                b: self.ptr(&b),
                b_f32: b.is_f32(),
                n: o.len as i64,
            },
        )
    }

    fn add_assign(&self, dst: ViewMut<'_>, src: View<'_>) -> Result<()> {
        let _t = self.timed("add_assign", OpClass::Elementwise, 0.0);
        check::len("add_assign", "src", src.len, &[dst.len])?;
        let d = dst.as_view();
        self.launch(
            grid_1d(d.len),
            kernel::add_assign {
                dst: self.ptr(&d),
                dst_f32: d.is_f32(),
                src: self.ptr(&src),
                src_f32: src.is_f32(),
                n: d.len as i64,
            },
        )
    }

    fn sum(&self, src: View<'_>) -> Result<f64> {
        let _t = self.timed("sum", OpClass::Reduction, 0.0);
        self.reduce("sum", src, false)
    }

    fn sum_squares(&self, src: View<'_>) -> Result<f64> {
        let _t = self.timed("sum_squares", OpClass::Reduction, 0.0);
        self.reduce("sum_squares", src, true)
    }

    fn embedding_forward(
        &self,
        out: ViewMut<'_>,
        ids: &Ints,
        table: View<'_>,
        tokens: usize,
        hidden: usize,
        scale: f32,
    ) -> Result<()> {
        let _t = self.timed("embedding_forward", OpClass::Embedding, 0.0);
        const OP: &str = "embedding_forward";
        let vocab = table_rows(OP, table.len, hidden)?;
        check::len(OP, "out", out.len, &[tokens, hidden])?;
        let host = check::ints(OP, "ids", &ids.host, tokens)?;
        check::ids(OP, "ids", host, vocab)?;
        let o = out.as_view();
        self.launch(
            grid_1d(o.len),
            kernel::embedding_forward {
                out: self.ptr(&o),
                out_f32: o.is_f32(),
                ids: self.ints_ptr(ids),
                table: self.ptr(&table),
                table_f32: table.is_f32(),
                tokens: tokens as i64,
                hidden: hidden as i64,
                scale,
            },
        )
    }

    /// Deterministic without atomics: the tokens are grouped by id on the host (stable, so each
    /// row sums its tokens in token order, as the CPU reference does), and one block owns each
    /// row.
    fn embedding_backward(
        &self,
        dtable: ViewMut<'_>,
        dout: View<'_>,
        ids: &Ints,
        tokens: usize,
        hidden: usize,
        scale: f32,
    ) -> Result<()> {
        let _t = self.timed("embedding_backward", OpClass::Embedding, 0.0);
        const OP: &str = "embedding_backward";
        let vocab = table_rows(OP, dtable.len, hidden)?;
        check::len(OP, "dout", dout.len, &[tokens, hidden])?;
        let host = check::ints(OP, "ids", &ids.host, tokens)?;
        check::ids(OP, "ids", host, vocab)?;
        if tokens == 0 {
            return Ok(());
        }
        check::int(OP, "tokens", tokens)?;
        let mut order: Vec<i32> = (0..tokens as i32).collect();
        order.sort_by_key(|&t| host[t as usize]);
        let (mut starts, mut rows) = (Vec::new(), Vec::new());
        for (k, &t) in order.iter().enumerate() {
            let id = host[t as usize];
            if rows.last() != Some(&id) {
                starts.push(k as i32);
                rows.push(id);
            }
        }
        starts.push(tokens as i32);
        self.bind()?;
        let order = drv(OP, self.compute.clone_htod(&order))?;
        let starts = drv(OP, self.compute.clone_htod(&starts))?;
        let groups = rows.len();
        let rows = drv(OP, self.compute.clone_htod(&rows))?;
        let d = dtable.as_view();
        self.launch(
            LaunchConfig {
                grid_dim: (groups as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            },
            kernel::embedding_backward {
                dtable: self.ptr(&d),
                dtable_f32: d.is_f32(),
                dout: self.ptr(&dout),
                dout_f32: dout.is_f32(),
                order: base_ptr(&order, &self.compute),
                starts: base_ptr(&starts, &self.compute),
                rows: base_ptr(&rows, &self.compute),
                hidden: hidden as i64,
                scale,
            },
        )?;
        // The host vectors were copied from pageable memory; the device copies live until the
        // kernel has run (freed in stream order when dropped).
        Ok(())
    }

    fn bias_forward(&self, out: ViewMut<'_>, bias: View<'_>, rows: usize, n: usize) -> Result<()> {
        let _t = self.timed("bias_forward", OpClass::Elementwise, 0.0);
        const OP: &str = "bias_forward";
        check::len(OP, "out", out.len, &[rows, n])?;
        check::len(OP, "bias", bias.len, &[n])?;
        if n == 0 {
            return Ok(());
        }
        let o = out.as_view();
        self.launch(
            grid_1d(o.len),
            kernel::bias_forward {
                out: self.ptr(&o),
                out_f32: o.is_f32(),
                bias: self.ptr(&bias),
                bias_f32: bias.is_f32(),
                rows: rows as i64,
                n: n as i64,
            },
        )
    }

    fn bias_backward(
        &self,
        dbias: ViewMut<'_>,
        dout: View<'_>,
        rows: usize,
        n: usize,
    ) -> Result<()> {
        let _t = self.timed("bias_backward", OpClass::Elementwise, 0.0);
        const OP: &str = "bias_backward";
        check::len(OP, "dbias", dbias.len, &[n])?;
        check::len(OP, "dout", dout.len, &[rows, n])?;
        self.column_sum(&dbias, &dout, rows, n)
    }

    fn glu_forward(
        &self,
        out: ViewMut<'_>,
        gu: View<'_>,
        rows: usize,
        inter: usize,
        act: GluAct,
    ) -> Result<()> {
        let _t = self.timed("glu_forward", OpClass::Activation, 0.0);
        const OP: &str = "glu_forward";
        check::len(OP, "out", out.len, &[rows, inter])?;
        check::len(OP, "gate_up", gu.len, &[rows, 2, inter])?;
        let o = out.as_view();
        if glu_vectors(act, inter) && self.vectors(&[&o, &gu]) {
            return self.launch(
                glu_vec_grid(rows, inter),
                kernel::glu_forward_vec {
                    out: self.ptr(&o),
                    gu: self.ptr(&gu),
                    rows: rows as i64,
                    vecs: check::int(OP, "inter", inter / 8)?,
                    act: glu_act_id(act),
                },
            );
        }
        self.launch(
            grid_1d(o.len),
            kernel::glu_forward {
                out: self.ptr(&o),
                out_f32: o.is_f32(),
                gu: self.ptr(&gu),
                gu_f32: gu.is_f32(),
                rows: rows as i64,
                inter: inter as i64,
                act: glu_act_id(act),
            },
        )
    }

    fn glu_backward(
        &self,
        dgu: ViewMut<'_>,
        dout: View<'_>,
        gu: View<'_>,
        rows: usize,
        inter: usize,
        act: GluAct,
    ) -> Result<()> {
        let _t = self.timed("glu_backward", OpClass::Activation, 0.0);
        const OP: &str = "glu_backward";
        check::len(OP, "dgate_up", dgu.len, &[rows, 2, inter])?;
        check::len(OP, "dout", dout.len, &[rows, inter])?;
        check::len(OP, "gate_up", gu.len, &[rows, 2, inter])?;
        let d = dgu.as_view();
        if glu_vectors(act, inter) && self.vectors(&[&d, &dout, &gu]) {
            return self.launch(
                glu_vec_grid(rows, inter),
                kernel::glu_backward_vec {
                    dgu: self.ptr(&d),
                    dout: self.ptr(&dout),
                    gu: self.ptr(&gu),
                    rows: rows as i64,
                    vecs: check::int(OP, "inter", inter / 8)?,
                    act: glu_act_id(act),
                },
            );
        }
        self.launch(
            grid_1d(dout.len),
            kernel::glu_backward {
                dgu: self.ptr(&d),
                dgu_f32: d.is_f32(),
                dout: self.ptr(&dout),
                dout_f32: dout.is_f32(),
                gu: self.ptr(&gu),
                gu_f32: gu.is_f32(),
                rows: rows as i64,
                inter: inter as i64,
                act: glu_act_id(act),
            },
        )
    }

    fn rope_forward(
        &self,
        qkv: ViewMut<'_>,
        pos: &Ints,
        inv_freq: View<'_>,
        scale: f32,
        shape: &AttentionShape,
    ) -> Result<()> {
        let _t = self.timed("rope_forward", OpClass::Rope, 0.0);
        self.rope(qkv, pos, inv_freq, scale, shape, 1.0)
    }

    fn rope_backward(
        &self,
        dqkv: ViewMut<'_>,
        pos: &Ints,
        inv_freq: View<'_>,
        scale: f32,
        shape: &AttentionShape,
    ) -> Result<()> {
        let _t = self.timed("rope_backward", OpClass::Rope, 0.0);
        self.rope(dqkv, pos, inv_freq, scale, shape, -1.0)
    }
}

/// Rows of a `[V, hidden]` table, whose length must be a whole number of rows.
fn table_rows(op: &str, len: usize, hidden: usize) -> Result<usize> {
    check::nonzero(op, "hidden", hidden)?;
    if !len.is_multiple_of(hidden) {
        return Err(check::err(
            op,
            format!("table has {len} elements, not a whole number of rows of {hidden}"),
        ));
    }
    Ok(len / hidden)
}

/// Whether the vectorized GLU kernels take this activation and width (with `vectors` for the
/// buffers): `[gate | up]` columns in whole 8-column vectors.
fn glu_vectors(act: GluAct, inter: usize) -> bool {
    act != GluAct::ClampedSwiglu && inter.is_multiple_of(8)
}

/// `glu_*_vec`'s grid: 8-column vectors across, rows down (a block loops over rows past the
/// y dimension's limit).
fn glu_vec_grid(rows: usize, inter: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((inter / 8).div_ceil(GLU_VEC_THREADS) as u32, rows.min(65535) as u32, 1),
        block_dim: (GLU_VEC_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The kernels' code for an activation (`glu_act` in elementwise.cu).
fn glu_act_id(act: GluAct) -> i32 {
    match act {
        GluAct::Silu => 0,
        GluAct::GeluTanh => 1,
        GluAct::ClampedSwiglu => 2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::Floats;
    use crate::backend::prelude::*;

    /// Values in [-scale, scale) from a fixed xorshift sequence.
    fn values(n: usize, mut x: u64, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                ((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect()
    }

    /// A bf16 buffer holding `v` from element `at` on: `at` = 1 puts the data 2 bytes off the
    /// allocation's alignment, which sends it to the generic kernels.
    fn put(g: &Cuda, v: &[f32], at: usize) -> Floats {
        let mut buf = g.alloc(at + v.len(), FloatKind::Activation).expect("alloc");
        g.upload(g.view_mut(&mut buf, at..at + v.len()), v).expect("upload");
        buf
    }

    fn bits(g: &Cuda, buf: &Floats, at: usize) -> Vec<u32> {
        let mut host = vec![0.0; g.len(buf) - at];
        g.download(&mut host, g.view(buf, at..g.len(buf))).expect("download");
        host.iter().map(|x| x.to_bits()).collect()
    }

    /// On a GPU: the vector kernels give the generic kernels' bits (tests/gpu/ checks both
    /// against the CPU). Without one (CI) there is nothing to run.
    #[test]
    fn vector_kernels_give_the_generic_kernels_bits() {
        let Ok(g) = Cuda::new(0) else { return };
        let (rows, inter) = (37, 80);
        let gu = values(rows * 2 * inter, 1, 6.0);
        let dout = values(rows * inter, 2, 1.0);
        for act in [GluAct::Silu, GluAct::GeluTanh] {
            let run = |at: usize| {
                let (gu, dout) = (put(&g, &gu, at), put(&g, &dout, at));
                let (n, n2) = (rows * inter, rows * 2 * inter);
                let (mut out, mut dgu) = (put(&g, &vec![0.0; n], at), put(&g, &vec![0.0; n2], at));
                let (gv, dv) = (g.view(&gu, at..at + n2), g.view(&dout, at..at + n));
                g.glu_forward(g.view_mut(&mut out, at..at + n), gv, rows, inter, act).expect("glu");
                let d = g.view_mut(&mut dgu, at..at + n2);
                g.glu_backward(d, dv, gv, rows, inter, act).expect("glu_backward");
                (bits(&g, &out, at), bits(&g, &dgu, at))
            };
            assert!(run(0) == run(1), "{act:?}: the vector and generic GLU kernels differ");
        }
        let shape = AttentionShape {
            tokens: 37,
            q_heads: 6,
            kv_heads: 2,
            head_dim: 128,
            docs: 1,
            window: None,
            scale_dim: None,
            softcap: None,
        };
        let n = shape.tokens * shape.qkv_width();
        let x = values(n, 3, 1.0);
        let mut pos = g.alloc_ints(shape.tokens).expect("alloc_ints");
        g.upload_ints(&mut pos, &(0..shape.tokens as i32).map(|t| t * 97).collect::<Vec<_>>())
            .expect("ints");
        // Partial rotary (48 of 64 pairs) with a cos/sin scale, as Phi-3's longrope.
        let inv: Vec<f32> = (0..48).map(|i| 10000f32.powf(-(i as f32) / 48.0)).collect();
        let mut freq = g.alloc(48, FloatKind::Accum).expect("alloc");
        g.upload(g.view_mut(&mut freq, 0..48), &inv).expect("upload");
        let run = |at: usize| {
            let mut q = put(&g, &x, at);
            let f = g.view(&freq, 0..48);
            g.rope_forward(g.view_mut(&mut q, at..at + n), &pos, f, 1.19, &shape).expect("rope");
            let forward = bits(&g, &q, at);
            g.rope_backward(g.view_mut(&mut q, at..at + n), &pos, f, 1.19, &shape).expect("rope");
            (forward, bits(&g, &q, at))
        };
        assert!(run(0) == run(1), "the vector and generic rope kernels differ");
    }

    #[test]
    fn only_aligned_bf16_views_take_the_vector_kernels() {
        assert!(bf16_vectors(FloatKind::Activation, 0x2010));
        assert!(!bf16_vectors(FloatKind::Activation, 0x2008));
        assert!(!bf16_vectors(FloatKind::Accum, 0x2000));
        assert!(glu_vectors(GluAct::Silu, 18944) && glu_vectors(GluAct::GeluTanh, 80));
        assert!(!glu_vectors(GluAct::Silu, 36) && !glu_vectors(GluAct::ClampedSwiglu, 2880));
    }
}
