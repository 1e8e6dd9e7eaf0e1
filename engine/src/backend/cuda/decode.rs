//! Attention of new queries against the key/value cache (`kernels/decode.cu`), for the inference
//! forward; the CPU twin is `backend/cpu/decode.rs`. q, the caches and out are bf16; GPT-OSS's
//! sinks either precision.

use cudarc::driver::LaunchConfig;

use super::kernel;
use super::{Cuda, View, ViewMut, check};
use crate::backend::{DecodeShape, FloatKind};
use crate::error::Result;

/// The kernel instantiation for a head size.
fn bucket(op: &str, hd: usize) -> Result<usize> {
    match hd {
        0..=32 => Ok(32),
        33..=64 => Ok(64),
        65..=128 => Ok(128),
        129..=256 => Ok(256),
        _ => Err(check::err(op, format!("head_dim {hd} exceeds the largest supported, 256"))),
    }
}

/// Threads per block: the kernel's `DW` warps.
const THREADS: u32 = 8 * 32;

impl Cuda {
    /// The attention against a KV cache, untimed: `AttentionOps::attention_decode` times it.
    pub(super) fn decode(
        &self,
        out: ViewMut<'_>,
        q: View<'_>,
        k_cache: View<'_>,
        v_cache: View<'_>,
        sinks: Option<View<'_>>,
        shape: &DecodeShape,
    ) -> Result<()> {
        const OP: &str = "attention_decode";
        check::decode_shape(OP, shape)?;
        let (n, nq, nkv, hd) = (shape.tokens, shape.q_heads, shape.kv_heads, shape.head_dim);
        let o = out.as_view();
        check::len(OP, "out", o.len, &[n, nq, hd])?;
        check::len(OP, "q", q.len, &[n, nq, hd])?;
        check::len(OP, "k_cache", k_cache.len, &[shape.positions(), nkv, hd])?;
        check::len(OP, "v_cache", v_cache.len, &[shape.positions(), nkv, hd])?;
        for (name, v) in [("out", &o), ("q", &q), ("k_cache", &k_cache), ("v_cache", &v_cache)] {
            check::kind(OP, name, v, FloatKind::Activation)?;
        }
        if let Some(s) = &sinks {
            check::len(OP, "sinks", s.len, &[nq])?;
        }
        let bucket = bucket(OP, hd)?;
        if nq > 65535 {
            return Err(check::err(OP, format!("{nq} query heads exceed the grid's 65535")));
        }
        // The kernel forms positions as `int`; a window covering every position is no window.
        check::int(OP, "past + tokens", shape.positions())?;
        let window = match shape.window {
            Some(w) if w < shape.positions() => w as i32,
            _ => 0,
        };
        let cfg = LaunchConfig {
            grid_dim: (check::int(OP, "tokens", n)? as u32, nq as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch_as(
            &format!("attention_decode_{bucket}"),
            cfg,
            kernel::attention_decode {
                out: self.ptr(&o),
                q: self.ptr(&q),
                kc: self.ptr(&k_cache),
                vc: self.ptr(&v_cache),
                // The kernel reads no sink through a null pointer.
                sinks: sinks.as_ref().map_or(0, |s| self.ptr(s)),
                sinks_f32: sinks.as_ref().map_or(0, View::is_f32),
                past: check::int(OP, "past", shape.past)?,
                nq: nq as i32,
                nkv: nkv as i32,
                hd: hd as i32,
                window,
                scale: shape.softmax_scale(),
                cap: shape.softcap.unwrap_or(0.0),
            },
        )
    }
}
