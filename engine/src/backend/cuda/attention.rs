//! Fused attention, forward and backward (`kernels/attention.cu`); the CPU twin with the
//! derivation is `backend/cpu/attention.rs`. qkv, out and their gradients are bf16; lse is f32.

use cudarc::driver::LaunchConfig;

use super::device::{Arg, base_ptr, scratch};
use super::{Cuda, Ints, View, ViewMut, check};
use crate::backend::{AttentionShape, FloatKind};
use crate::error::Result;

/// The kernel instantiation for a head size: (bucket, rows per warp).
fn bucket(op: &str, hd: usize) -> Result<(usize, usize)> {
    match hd {
        0..=32 => Ok((32, 4)),
        33..=64 => Ok((64, 4)),
        65..=128 => Ok((128, 4)),
        129..=256 => Ok((256, 2)),
        _ => Err(check::err(op, format!("head_dim {hd} exceeds the largest supported, 256"))),
    }
}

/// The sizes every attention kernel takes, checked to fit its `int` parameters.
struct Sizes {
    docs: i32,
    tokens: i32,
    nq: i32,
    nkv: i32,
    hd: i32,
    /// 0 for no window; a window covering every document is no window.
    window: i32,
    scale: f32,
}

impl Sizes {
    fn new(op: &str, shape: &AttentionShape) -> Result<Sizes> {
        Ok(Sizes {
            docs: check::int(op, "docs", shape.docs)?,
            tokens: check::int(op, "tokens", shape.tokens)?,
            nq: check::int(op, "q_heads", shape.q_heads)?,
            nkv: check::int(op, "kv_heads", shape.kv_heads)?,
            hd: check::int(op, "head_dim", shape.head_dim)?,
            window: match shape.window {
                Some(w) if w < shape.tokens => w as i32,
                _ => 0,
            },
            scale: 1.0 / (shape.head_dim as f32).sqrt(),
        })
    }

    fn args(&self) -> [Arg; 6] {
        [
            Arg::I32(self.tokens),
            Arg::I32(self.nq),
            Arg::I32(self.nkv),
            Arg::I32(self.hd),
            Arg::I32(self.window),
            Arg::F32(self.scale),
        ]
    }
}

fn config(blocks: usize, heads: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks as u32, heads as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl Cuda {
    fn attention_common(
        &self,
        op: &str,
        qkv: &View<'_>,
        cu: &Ints,
        shape: &AttentionShape,
    ) -> Result<(Sizes, usize, usize)> {
        let width = check::attention_shape(op, shape)?;
        check::len(op, "qkv", qkv.len, &[shape.tokens, width])?;
        check::kind(op, "qkv", qkv, FloatKind::Activation)?;
        check::documents(op, &cu.host, shape)?;
        if shape.q_heads > 65535 || shape.kv_heads > 65535 {
            return Err(check::err(op, "more than 65535 heads"));
        }
        let (hd, rows_per_warp) = bucket(op, shape.head_dim)?;
        Ok((Sizes::new(op, shape)?, hd, rows_per_warp))
    }

    pub(super) fn attention_forward_op(
        &self,
        out: ViewMut<'_>,
        lse: ViewMut<'_>,
        qkv: View<'_>,
        cu: &Ints,
        shape: &AttentionShape,
    ) -> Result<()> {
        const OP: &str = "attention_forward";
        let (s, hd, qw) = self.attention_common(OP, &qkv, cu, shape)?;
        let (o, l) = (out.as_view(), lse.as_view());
        check::len(OP, "out", o.len, &[shape.tokens, shape.q_heads, shape.head_dim])?;
        check::len(OP, "lse", l.len, &[shape.tokens, shape.q_heads])?;
        check::kind(OP, "out", &o, FloatKind::Activation)?;
        check::kind(OP, "lse", &l, FloatKind::Accum)?;
        let mut args = vec![
            Arg::Ptr(self.ptr(&o)),
            Arg::Ptr(self.ptr(&l)),
            Arg::Ptr(self.ptr(&qkv)),
            Arg::Ptr(self.ints_ptr(cu)),
            Arg::I32(s.docs),
        ];
        args.extend(s.args());
        let blocks = shape.tokens.div_ceil(4 * qw);
        self.launch(&format!("attention_forward_{hd}"), config(blocks, shape.q_heads), &args)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_backward_op(
        &self,
        dqkv: ViewMut<'_>,
        dout: View<'_>,
        qkv: View<'_>,
        out: View<'_>,
        lse: View<'_>,
        cu: &Ints,
        shape: &AttentionShape,
    ) -> Result<()> {
        const OP: &str = "attention_backward";
        let (s, hd, qw) = self.attention_common(OP, &qkv, cu, shape)?;
        let (t, nq) = (shape.tokens, shape.q_heads);
        let d = dqkv.as_view();
        check::len(OP, "dqkv", d.len, &[t, shape.qkv_width()])?;
        check::len(OP, "dout", dout.len, &[t, nq, shape.head_dim])?;
        check::len(OP, "out", out.len, &[t, nq, shape.head_dim])?;
        check::len(OP, "lse", lse.len, &[t, nq])?;
        check::kind(OP, "dqkv", &d, FloatKind::Activation)?;
        check::kind(OP, "dout", &dout, FloatKind::Activation)?;
        check::kind(OP, "out", &out, FloatKind::Activation)?;
        check::kind(OP, "lse", &lse, FloatKind::Accum)?;
        if t == 0 {
            return Ok(());
        }
        if nq == 0 {
            // No query heads: nothing attends, so every key and value gradient is zero.
            return self.zero(&dqkv);
        }
        // D_i = dout_i · out_i, per query and head.
        let dsum = scratch::<f32>(&self.compute, t * nq)?;
        let dsum_ptr = base_ptr(&dsum, &self.compute);
        self.launch(
            "attention_backward_dot",
            LaunchConfig {
                grid_dim: ((t * nq).div_ceil(4) as u32, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            },
            &[
                Arg::Ptr(dsum_ptr),
                Arg::Ptr(self.ptr(&dout)),
                Arg::Ptr(self.ptr(&out)),
                Arg::I64((t * nq) as i64),
                Arg::I32(s.hd),
            ],
        )?;
        let mut args = vec![
            Arg::Ptr(self.ptr(&d)),
            Arg::Ptr(self.ptr(&dout)),
            Arg::Ptr(self.ptr(&qkv)),
            Arg::Ptr(self.ptr(&lse)),
            Arg::Ptr(dsum_ptr),
            Arg::Ptr(self.ints_ptr(cu)),
            Arg::I32(s.docs),
        ];
        args.extend(s.args());
        let rows = 4 * qw;
        self.launch(&format!("attention_backward_dq_{hd}"), config(t.div_ceil(rows), nq), &args)?;
        self.launch(
            &format!("attention_backward_dkv_{hd}"),
            config(t.div_ceil(rows), shape.kv_heads),
            &args,
        )
    }
}
