//! The CPU backend: the clean, minimal reference that defines what every op computes. Plain f32
//! loops (GEMMs through `matrixmultiply`), spread over rayon's threads where that costs no
//! clarity; the GPU backend specialises it and is tested against it.
//!
//! Each op family lives in its own file as free functions `<op>_forward` / `<op>_backward`
//! taking plain slices in the trait's argument order (outputs, inputs, sizes), each citing the
//! transformers code it mirrors; [`Cpu`] only forwards to them. Every op checks its slice
//! lengths, ids and document bounds before writing anything and answers `Error::Backend` naming
//! the op and the expected versus actual value. Results do not depend on the number of threads:
//! parallel reductions combine fixed-size partials in a fixed order.

mod attention;
pub(in crate::backend) mod check;
mod decode;
mod elementwise;
mod embedding;
mod loss;
mod matmul;
mod mlp;
mod moe;
mod norm;
mod rope;

#[cfg(test)]
mod testutil;

use std::ops::Range;

pub use attention::{
    attention_backward, attention_forward, attention_sinks_backward, attention_sinks_forward,
};
pub use decode::attention_decode;
pub use elementwise::{add, add_assign, sum, sum_squares};
pub use embedding::{embedding_backward, embedding_forward};
pub use loss::{CHUNK_TOKENS as LOSS_CHUNK_TOKENS, cross_entropy_backward, cross_entropy_forward};
pub use matmul::{
    bias_backward, bias_forward, matmul_backward, matmul_forward, matmul_forward_add,
};
pub use mlp::{glu_backward, glu_forward};
pub use moe::{
    grouped_bias_backward, grouped_matmul_backward, grouped_matmul_forward, moe_combine,
    moe_combine_backward, moe_gather, moe_gather_backward, moe_route, moe_route_backward,
    moe_router_stats, moe_sort, sigmoid_gate_backward, sigmoid_gate_forward,
};
pub use norm::{
    head_rmsnorm_backward, head_rmsnorm_forward, rmsnorm_backward, rmsnorm_backward_add,
    rmsnorm_forward,
};
pub use rope::{rope_backward, rope_forward};

use super::{
    Addends, AttentionOps, AttentionOut, AttentionShape, DecodeShape, Device, ElementwiseOps,
    FloatKind, GluAct, Grads, GroupedShape, LossOps, LossOut, LossShape, MatmulOps, MatmulShape,
    MoeOps, MoeShape, NormOps, NormShape, Operands, Routing, WeightDtype,
};
use crate::error::Result;
use crate::store::HostSlab;

/// The f32 elements `offset..offset + len * 4` bytes of a slab name, or an error.
fn slab_range(
    op: &str,
    slab_bytes: usize,
    offset: usize,
    len: usize,
) -> Result<std::ops::Range<usize>> {
    let end = offset.checked_add(len * 4).filter(|&e| e <= slab_bytes && offset.is_multiple_of(4));
    match end {
        Some(end) => Ok(offset / 4..end / 4),
        None => Err(crate::error::Error::Backend {
            backend: "cpu".into(),
            message: format!(
                "{op}: {len} f32 at byte {offset} do not fit a host slab of {slab_bytes} bytes"
            ),
        }),
    }
}

/// The reference backend: host memory, f32 for every [`FloatKind`], rayon's global thread pool.
#[derive(Debug, Default, Clone, Copy)]
pub struct Cpu;

impl Cpu {
    pub fn new() -> Self {
        Cpu
    }
}

impl Device for Cpu {
    type Floats = Vec<f32>;
    type Ints = Vec<i32>;
    type View<'a> = &'a [f32];
    type ViewMut<'a> = &'a mut [f32];
    type Stream = ();
    type Event = ();
    type Mark = ();

    fn name(&self) -> String {
        "cpu".into()
    }

    fn synchronous(&self) -> bool {
        true
    }

    fn weight_dtype(&self) -> WeightDtype {
        WeightDtype::F32
    }

    fn pin(&self, _slab: &mut HostSlab) -> Result<()> {
        Ok(())
    }

    fn new_stream(&self) -> Result<()> {
        Ok(())
    }

    fn new_event(&self) -> Result<()> {
        Ok(())
    }

    fn compute_stream(&self) {}

    fn record(&self, _event: &(), _stream: &()) -> Result<()> {
        Ok(())
    }

    fn wait(&self, _stream: &(), _event: &()) -> Result<()> {
        Ok(())
    }

    fn mark(&self, _stream: &()) -> Result<()> {
        Ok(())
    }

    fn elapsed(&self, _a: &(), _b: &()) -> Result<Option<std::time::Duration>> {
        Ok(None)
    }

    fn synchronize(&self, _event: &()) -> Result<()> {
        Ok(())
    }

    // Copies run before the call returns, so the caller's obligations end with the call.
    unsafe fn upload_on(
        &self,
        _stream: &(),
        dst: &mut [f32],
        src: &HostSlab,
        offset: usize,
    ) -> Result<()> {
        let range = slab_range("upload_on", src.bytes(), offset, dst.len())?;
        dst.copy_from_slice(&src.as_f32()[range]);
        Ok(())
    }

    unsafe fn download_on(
        &self,
        _stream: &(),
        dst: &mut HostSlab,
        offset: usize,
        src: &[f32],
    ) -> Result<()> {
        let range = slab_range("download_on", dst.bytes(), offset, src.len())?;
        dst.as_f32_mut()[range].copy_from_slice(src);
        Ok(())
    }

    fn alloc(&self, len: usize, _kind: FloatKind) -> Result<Vec<f32>> {
        Ok(vec![0.0; len])
    }

    fn upload_vec(&self, src: Vec<f32>, _kind: FloatKind) -> Result<Vec<f32>> {
        Ok(src)
    }

    fn alloc_ints(&self, len: usize) -> Result<Vec<i32>> {
        Ok(vec![0; len])
    }

    fn len(&self, buf: &Vec<f32>) -> usize {
        buf.len()
    }

    /// A range outside the buffer gives an empty view (the trait's `view` cannot fail), which the
    /// next op using it rejects for its length.
    fn view<'a>(&self, buf: &'a Vec<f32>, range: Range<usize>) -> &'a [f32] {
        buf.get(range).unwrap_or_default()
    }

    /// As [`Cpu::view`]: a range outside the buffer gives an empty view.
    fn view_mut<'a>(&self, buf: &'a mut Vec<f32>, range: Range<usize>) -> &'a mut [f32] {
        buf.get_mut(range).unwrap_or_default()
    }

    fn upload(&self, dst: &mut [f32], src: &[f32]) -> Result<()> {
        check::len("upload", "src", src.len(), &[dst.len()])?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn download(&self, dst: &mut [f32], src: &[f32]) -> Result<()> {
        check::len("download", "src", src.len(), &[dst.len()])?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn upload_ints(&self, dst: &mut Vec<i32>, src: &[i32]) -> Result<()> {
        let capacity = dst.len();
        let prefix = dst.get_mut(..src.len()).ok_or_else(|| {
            check::err(
                "upload_ints",
                format!("{} ints do not fit a buffer of {capacity}", src.len()),
            )
        })?;
        prefix.copy_from_slice(src);
        Ok(())
    }
}

impl ElementwiseOps for Cpu {
    fn fill_zero(&self, dst: &mut [f32]) -> Result<()> {
        dst.fill(0.0);
        Ok(())
    }

    fn copy(&self, dst: &mut [f32], src: &[f32]) -> Result<()> {
        check::len("copy", "src", src.len(), &[dst.len()])?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn add(&self, out: &mut [f32], a: &[f32], b: &[f32]) -> Result<()> {
        add(out, a, b)
    }

    fn add_assign(&self, dst: &mut [f32], src: &[f32]) -> Result<()> {
        add_assign(dst, src)
    }

    fn sum(&self, src: &[f32]) -> Result<f64> {
        sum(src)
    }

    fn sum_squares(&self, src: &[f32]) -> Result<f64> {
        sum_squares(src)
    }

    fn embedding_forward(
        &self,
        out: &mut [f32],
        ids: &Vec<i32>,
        table: &[f32],
        tokens: usize,
        hidden: usize,
        scale: f32,
    ) -> Result<()> {
        embedding_forward(out, ids, table, tokens, hidden, scale)
    }

    fn embedding_backward(
        &self,
        dtable: &mut [f32],
        dout: &[f32],
        ids: &Vec<i32>,
        tokens: usize,
        hidden: usize,
        scale: f32,
    ) -> Result<()> {
        embedding_backward(dtable, dout, ids, tokens, hidden, scale)
    }

    fn bias_forward(&self, out: &mut [f32], bias: &[f32], rows: usize, n: usize) -> Result<()> {
        bias_forward(out, bias, rows, n)
    }

    fn bias_backward(&self, dbias: &mut [f32], dout: &[f32], rows: usize, n: usize) -> Result<()> {
        bias_backward(dbias, dout, rows, n)
    }

    fn rope_forward(
        &self,
        qkv: &mut [f32],
        pos: &Vec<i32>,
        inv_freq: &[f32],
        scale: f32,
        shape: &AttentionShape,
    ) -> Result<()> {
        rope_forward(qkv, pos, inv_freq, scale, shape)
    }

    fn rope_backward(
        &self,
        dqkv: &mut [f32],
        pos: &Vec<i32>,
        inv_freq: &[f32],
        scale: f32,
        shape: &AttentionShape,
    ) -> Result<()> {
        rope_backward(dqkv, pos, inv_freq, scale, shape)
    }

    fn glu_forward(
        &self,
        out: &mut [f32],
        gate_up: &[f32],
        rows: usize,
        inter: usize,
        act: GluAct,
    ) -> Result<()> {
        glu_forward(out, gate_up, rows, inter, act)
    }

    fn glu_backward(
        &self,
        dgate_up: &mut [f32],
        dout: &[f32],
        gate_up: &[f32],
        rows: usize,
        inter: usize,
        act: GluAct,
    ) -> Result<()> {
        glu_backward(dgate_up, dout, gate_up, rows, inter, act)
    }
}

impl MatmulOps for Cpu {
    fn matmul_forward(
        &self,
        out: &mut [f32],
        operands: Operands<&[f32]>,
        shape: &MatmulShape,
    ) -> Result<()> {
        matmul_forward(out, operands, shape)
    }

    fn matmul_forward_add(
        &self,
        out: &mut [f32],
        operands: Operands<&[f32]>,
        addends: Addends<&[f32]>,
        shape: &MatmulShape,
    ) -> Result<()> {
        matmul_forward_add(out, operands, addends, shape)
    }

    fn matmul_backward(
        &self,
        grads: Grads<&mut [f32]>,
        dout: &[f32],
        operands: Operands<&[f32]>,
        shape: &MatmulShape,
    ) -> Result<()> {
        matmul_backward(grads, dout, operands, shape)
    }
}

impl NormOps for Cpu {
    fn rmsnorm_forward(
        &self,
        out: &mut [f32],
        rstd: &mut [f32],
        operands: Operands<&[f32]>,
        shape: &NormShape,
    ) -> Result<()> {
        rmsnorm_forward(out, rstd, operands, shape)
    }

    fn rmsnorm_backward(
        &self,
        grads: Grads<&mut [f32]>,
        dout: &[f32],
        operands: Operands<&[f32]>,
        rstd: &[f32],
        shape: &NormShape,
    ) -> Result<()> {
        rmsnorm_backward(grads, dout, operands, rstd, shape)
    }

    fn rmsnorm_backward_add(
        &self,
        grads: Grads<&mut [f32]>,
        dout: &[f32],
        operands: Operands<&[f32]>,
        rstd: &[f32],
        residual: &[f32],
        shape: &NormShape,
    ) -> Result<()> {
        rmsnorm_backward_add(grads, dout, operands, rstd, residual, shape)
    }

    fn head_rmsnorm_forward(
        &self,
        out: &mut [f32],
        rstd: &mut [f32],
        operands: Operands<&[f32]>,
        shape: &AttentionShape,
        eps: f32,
    ) -> Result<()> {
        head_rmsnorm_forward(out, rstd, operands, shape, eps)
    }

    fn head_rmsnorm_backward(
        &self,
        grads: Grads<&mut [f32]>,
        dout: &[f32],
        operands: Operands<&[f32]>,
        rstd: &[f32],
        shape: &AttentionShape,
    ) -> Result<()> {
        head_rmsnorm_backward(grads, dout, operands, rstd, shape)
    }
}

impl AttentionOps for Cpu {
    fn attention_forward(
        &self,
        att: AttentionOut<&mut [f32]>,
        qkv: &[f32],
        cu_seqlens: &Vec<i32>,
        shape: &AttentionShape,
    ) -> Result<()> {
        attention_forward(att, qkv, cu_seqlens, shape)
    }

    fn attention_backward(
        &self,
        dqkv: &mut [f32],
        dout: &[f32],
        qkv: &[f32],
        att: AttentionOut<&[f32]>,
        cu_seqlens: &Vec<i32>,
        shape: &AttentionShape,
    ) -> Result<()> {
        attention_backward(dqkv, dout, qkv, att, cu_seqlens, shape)
    }

    fn attention_decode(
        &self,
        out: &mut [f32],
        q: &[f32],
        k_cache: &[f32],
        v_cache: &[f32],
        sinks: Option<&[f32]>,
        shape: &DecodeShape,
    ) -> Result<()> {
        attention_decode(out, q, k_cache, v_cache, sinks, shape)
    }

    fn attention_sinks_forward(
        &self,
        att: AttentionOut<&mut [f32]>,
        sinks: &[f32],
        shape: &AttentionShape,
    ) -> Result<()> {
        attention_sinks_forward(att, sinks, shape)
    }

    fn attention_sinks_backward(
        &self,
        dsinks: &mut [f32],
        dout: &[f32],
        att: AttentionOut<&[f32]>,
        sinks: &[f32],
        shape: &AttentionShape,
    ) -> Result<()> {
        attention_sinks_backward(dsinks, dout, att, sinks, shape)
    }
}

impl MoeOps for Cpu {
    fn moe_route(
        &self,
        weights: &mut [f32],
        probs: &mut [f32],
        experts: &mut Vec<i32>,
        logits: &[f32],
        shape: &MoeShape,
    ) -> Result<()> {
        moe_route(weights, probs, experts, logits, shape)
    }

    fn moe_route_backward(
        &self,
        dlogits: &mut [f32],
        dweights: &[f32],
        routing: Routing<&[f32], &Vec<i32>>,
        aux: Option<(&[f32], f32)>,
        shape: &MoeShape,
    ) -> Result<()> {
        let Routing { weights, probs, experts } = routing;
        let routing = Routing { weights, probs, experts: experts.as_slice() };
        moe_route_backward(dlogits, dweights, routing, aux, shape)
    }

    fn moe_router_stats(
        &self,
        stats: &mut [f32],
        probs: &[f32],
        experts: &Vec<i32>,
        shape: &MoeShape,
    ) -> Result<()> {
        moe_router_stats(stats, probs, experts, shape)
    }

    fn moe_sort(
        &self,
        order: &mut Vec<i32>,
        rows: &mut Vec<i32>,
        experts: &Vec<i32>,
        shape: &MoeShape,
    ) -> Result<Vec<usize>> {
        moe_sort(order, rows, experts, shape)
    }

    fn moe_gather(
        &self,
        xs: &mut [f32],
        x: &[f32],
        order: &Vec<i32>,
        shape: &MoeShape,
    ) -> Result<()> {
        moe_gather(xs, x, order, shape)
    }

    fn moe_gather_backward(
        &self,
        dx: &mut [f32],
        dxs: &[f32],
        rows: &Vec<i32>,
        shape: &MoeShape,
    ) -> Result<()> {
        moe_gather_backward(dx, dxs, rows, shape)
    }

    fn moe_combine(
        &self,
        out: &mut [f32],
        y: &[f32],
        weights: &[f32],
        rows: &Vec<i32>,
        shape: &MoeShape,
    ) -> Result<()> {
        moe_combine(out, y, weights, rows, shape)
    }

    fn moe_combine_backward(
        &self,
        grads: Grads<&mut [f32]>,
        dout: &[f32],
        y: &[f32],
        weights: &[f32],
        rows: &Vec<i32>,
        shape: &MoeShape,
    ) -> Result<()> {
        moe_combine_backward(grads, dout, y, weights, rows, shape)
    }

    fn sigmoid_gate_forward(
        &self,
        out: &mut [f32],
        y: &[f32],
        logits: &[f32],
        shape: &MoeShape,
    ) -> Result<()> {
        sigmoid_gate_forward(out, y, logits, shape)
    }

    fn sigmoid_gate_backward(
        &self,
        dy: &mut [f32],
        dlogits: &mut [f32],
        dout: &[f32],
        y: &[f32],
        logits: &[f32],
        shape: &MoeShape,
    ) -> Result<()> {
        sigmoid_gate_backward(dy, dlogits, dout, y, logits, shape)
    }

    fn grouped_matmul_forward(
        &self,
        out: &mut [f32],
        operands: Operands<&[f32]>,
        bias: Option<&[f32]>,
        g: &GroupedShape<'_>,
    ) -> Result<()> {
        grouped_matmul_forward(out, operands, bias, g)
    }

    fn grouped_matmul_backward(
        &self,
        grads: Grads<&mut [f32]>,
        dout: &[f32],
        operands: Operands<&[f32]>,
        g: &GroupedShape<'_>,
    ) -> Result<()> {
        grouped_matmul_backward(grads, dout, operands, g)
    }

    fn grouped_bias_backward(
        &self,
        dbias: &mut [f32],
        dout: &[f32],
        g: &GroupedShape<'_>,
    ) -> Result<()> {
        grouped_bias_backward(dbias, dout, g)
    }
}

impl LossOps for Cpu {
    fn cross_entropy_forward(
        &self,
        losses: &mut [f32],
        lse: &mut [f32],
        operands: Operands<&[f32]>,
        targets: &Vec<i32>,
        shape: &LossShape,
    ) -> Result<()> {
        cross_entropy_forward(losses, lse, operands, targets, shape)
    }

    fn cross_entropy_backward(
        &self,
        grads: Grads<&mut [f32]>,
        operands: Operands<&[f32]>,
        lse: &[f32],
        targets: &Vec<i32>,
        scale: f32,
        shape: &LossShape,
    ) -> Result<()> {
        cross_entropy_backward(grads, operands, lse, targets, scale, shape)
    }

    fn cross_entropy_forward_backward(
        &self,
        out: LossOut<&mut [f32]>,
        grads: Grads<&mut [f32]>,
        operands: Operands<&[f32]>,
        targets: &Vec<i32>,
        scale: f32,
        shape: &LossShape,
    ) -> Result<()> {
        let LossOut { losses, lse } = out;
        cross_entropy_forward(losses, lse, operands, targets, shape)?;
        cross_entropy_backward(grads, operands, lse, targets, scale, shape)
    }
}

#[cfg(test)]
mod tests {
    use super::testutil::{rng, uniform};
    use super::*;
    use crate::error::Result;

    #[test]
    fn memory_ops_check_lengths() -> Result<()> {
        let cpu = Cpu::new();
        let mut buf = cpu.alloc(6, FloatKind::Activation)?;
        assert_eq!(cpu.len(&buf), 6);
        cpu.upload(cpu.view_mut(&mut buf, 2..5), &[1.0, 2.0, 3.0])?;
        assert_eq!(buf, [0.0, 0.0, 1.0, 2.0, 3.0, 0.0]);
        let e = cpu.upload(cpu.view_mut(&mut buf, 0..2), &[1.0]).expect_err("must be rejected");
        assert!(e.to_string().contains("upload"), "{e}");
        let mut host = [0.0; 2];
        cpu.download(&mut host, cpu.view(&buf, 3..5))?;
        assert_eq!(host, [2.0, 3.0]);
        // A range past the end gives an empty view, which the next op rejects by its length.
        assert!(cpu.view(&buf, 4..9).is_empty());
        assert!(cpu.download(&mut host, cpu.view(&buf, 4..9)).is_err());

        let mut ints = cpu.alloc_ints(3)?;
        cpu.upload_ints(&mut ints, &[7, 8])?;
        assert_eq!(ints, [7, 8, 0]);
        let e = cpu.upload_ints(&mut ints, &[1, 2, 3, 4]).expect_err("must be rejected");
        assert!(e.to_string().contains("upload_ints"), "{e}");
        Ok(())
    }

    /// Reductions must not depend on how many threads ran them (exact resume relies on it).
    #[test]
    fn results_do_not_depend_on_the_thread_count() -> Result<()> {
        let (rows, k, n) = (300, 17, 40);
        let mut rng = rng(110);
        let (inp, w, dout) =
            (uniform(&mut rng, rows * k), uniform(&mut rng, n * k), uniform(&mut rng, rows * n));
        let run = || -> Result<_> {
            let (mut dinp, mut dw, mut dbias) =
                (vec![0.0; rows * k], vec![0.0; n * k], vec![0.0; n]);
            let grads = Grads { dinp: &mut dinp[..], dw: &mut dw[..] };
            let shape = MatmulShape { rows, k, n };
            matmul_backward(grads, &dout, Operands { inp: &inp, w: &w }, &shape)?;
            bias_backward(&mut dbias, &dout, rows, n)?;
            let (mut dnorm, mut dnw) = (vec![0.0; rows * n], vec![0.0; n]);
            rmsnorm_backward(
                Grads { dinp: &mut dnorm, dw: &mut dnw },
                &dout,
                Operands { inp: &dout, w: &dbias },
                &vec![0.5; rows],
                &NormShape { rows, dim: n, eps: 1e-6 },
            )?;
            Ok((dinp, dw, dbias, dnorm, dnw, sum_squares(&dout)?))
        };
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .expect("a thread pool")
            .install(run)?;
        let three = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .expect("a thread pool")
            .install(run)?;
        assert!(one == three, "results differ between 1 and 3 threads");
        Ok(())
    }
}
