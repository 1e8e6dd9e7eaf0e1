//! Fused attention, forward and backward, and GPT-OSS's attention sinks applied to its results
//! (`kernels/attention.cu`); the CPU twin with the derivation is `backend/cpu/attention.rs`.
//! qkv, out and their gradients are bf16; lse is f32.
//!
//! Head sizes 64, 80, 96, 128 and 256 run on the tensor-core kernels (`flash_*`), every other
//! size up to 256 on the scalar ones (`attention_*`), as do views not aligned to 16 bytes (the
//! tensor-core kernels copy rows in 16-byte pieces).

use cudarc::driver::LaunchConfig;

use super::device::{base_ptr, scratch};
use super::elementwise::COLUMN_CHUNKS;
use super::kernel;
use super::profile::{self, OpClass};
use super::{Cuda, Ints, View, ViewMut, check};
use crate::backend::{AttentionOps, AttentionOut, AttentionShape, DecodeShape, FloatKind};
use crate::error::Result;

/// The scalar kernels' instantiation for a head size: (bucket, rows per warp).
fn bucket(op: &str, hd: usize) -> Result<(usize, usize)> {
    match hd {
        0..=32 => Ok((32, 4)),
        33..=64 => Ok((64, 4)),
        65..=128 => Ok((128, 4)),
        129..=256 => Ok((256, 2)),
        _ => Err(check::err(op, format!("head_dim {hd} exceeds the largest supported, 256"))),
    }
}

/// One tensor-core kernel's tile shape, as `FLASH_ENTRY_POINTS` / `FLASH_DKV_ENTRY_POINT`
/// instantiate it: `warps` warps of 16 rows each, tiles of `tile` tokens on the other side,
/// `stages` shared buffers for those tiles.
#[derive(Debug, Clone, Copy)]
struct Tiles {
    name: &'static str,
    warps: usize,
    tile: usize,
    stages: usize,
}

impl Tiles {
    const fn new(name: &'static str, warps: usize, tile: usize, stages: usize) -> Tiles {
        Tiles { name, warps, tile, stages }
    }

    /// Rows per block (16 per warp).
    fn rows(&self) -> usize {
        16 * self.warps
    }

    fn config(&self, blocks: usize, heads: usize, shared: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (blocks as u32, heads as u32, 1),
            block_dim: (32 * self.warps as u32, 1, 1),
            shared_mem_bytes: shared as u32,
        }
    }
}

/// The tensor-core kernels of one head size. Shared memory per block, in bytes, mirrors the
/// kernels' layouts: padded rows of `hd + 8` bf16.
struct Flash {
    hd: usize,
    forward: Tiles,
    dq: Tiles,
    /// dk and dv together, or (at head_dim 256) dv then dk, each with whether it writes dk.
    dkv: &'static [(Tiles, bool)],
    /// dq, dk and dv in one kernel, where this head size has one: `warps` warps of 16 keys,
    /// query tiles of `tile`.
    fused: Option<Tiles>,
}

const FLASH: [Flash; 5] = [
    Flash {
        hd: 64,
        forward: Tiles::new("flash_forward_64", 4, 64, 2),
        dq: Tiles::new("flash_backward_dq_64", 4, 32, 2),
        dkv: &[(Tiles::new("flash_backward_dkv_64", 4, 32, 2), true)],
        fused: Some(Tiles::new("flash_backward_fused_64", 8, 32, 2)),
    },
    Flash {
        hd: 80,
        forward: Tiles::new("flash_forward_80", 4, 64, 2),
        dq: Tiles::new("flash_backward_dq_80", 4, 32, 2),
        dkv: &[(Tiles::new("flash_backward_dkv_80", 4, 32, 2), true)],
        fused: None,
    },
    Flash {
        hd: 96,
        forward: Tiles::new("flash_forward_96", 4, 64, 2),
        dq: Tiles::new("flash_backward_dq_96", 4, 32, 2),
        dkv: &[(Tiles::new("flash_backward_dkv_96", 4, 32, 2), true)],
        fused: None,
    },
    Flash {
        hd: 128,
        forward: Tiles::new("flash_forward_128", 4, 64, 2),
        dq: Tiles::new("flash_backward_dq_128", 4, 32, 2),
        dkv: &[(Tiles::new("flash_backward_dkv_128", 4, 32, 2), true)],
        fused: Some(Tiles::new("flash_backward_fused_128", 8, 32, 2)),
    },
    Flash {
        hd: 256,
        forward: Tiles::new("flash_forward_256", 4, 32, 1),
        dq: Tiles::new("flash_backward_dq_256", 2, 16, 2),
        dkv: &[
            (Tiles::new("flash_backward_dv_256", 4, 32, 1), false),
            (Tiles::new("flash_backward_dk_256", 2, 16, 2), true),
        ],
        fused: None,
    },
];

impl Flash {
    fn row_bytes(&self) -> usize {
        2 * (self.hd + 8)
    }

    /// Q tile, then `stages` K and V tiles.
    fn forward_shared(&self) -> usize {
        let t = &self.forward;
        (t.rows() + 2 * t.stages * t.tile) * self.row_bytes()
    }

    /// Q and dout tiles, then `stages` K and V tiles.
    fn dq_shared(&self) -> usize {
        let t = &self.dq;
        (2 * t.rows() + 2 * t.stages * t.tile) * self.row_bytes()
    }

    /// K (and V when it writes dk), then `stages` of Q and dout tiles with their lse and D.
    fn dkv_shared(&self, t: &Tiles, writes_dk: bool) -> usize {
        let kv = if writes_dk { 2 } else { 1 };
        kv * t.rows() * self.row_bytes() + t.stages * (2 * t.tile * self.row_bytes() + 8 * t.tile)
    }

    /// The dk/dv layout with K and V (two stages), then the tile's dS (bf16, rows of
    /// `rows + 8`) and the running dq of two tiles (f32, rows of `hd + 8`).
    fn fused_shared(&self, t: &Tiles) -> usize {
        self.dkv_shared(t, true) + t.tile * (t.rows() + 8) * 2 + 2 * t.tile * (self.hd + 8) * 4
    }
}

/// Static shared memory the fused kernel declares besides the dynamic (its ticket and four
/// counts), rounded up.
const FUSED_STATIC_SHARED: usize = 64;

/// The Hopper forward kernels (`hopper_forward_*`, sm_90a) by head size.
const HOPPER_FORWARD: [(usize, &str); 2] = [(64, "hopper_forward_64"), (128, "hopper_forward_128")];

/// Queries a Hopper forward block takes (two warpgroups of 64); its key tiles are as long.
const HOPPER_ROWS: usize = 128;

/// The Hopper forward's dynamic shared memory: 1,024 bytes to align the tiles to the swizzle's
/// 1,024-byte pattern, the Q tile, and two stages of K and V tiles.
fn hopper_forward_shared(hd: usize) -> usize {
    1024 + HOPPER_ROWS * hd * 2 + 4 * HOPPER_ROWS * hd * 2
}

/// The Hopper backward kernels (sm_90a) by head size: dq, then dk and dv.
const HOPPER_BACKWARD: [(usize, &str, &str); 2] = [
    (64, "hopper_backward_dq_64", "hopper_backward_dkv_64"),
    (128, "hopper_backward_dq_128", "hopper_backward_dkv_128"),
];

/// The Hopper dq kernel's key tiles and the dk/dv kernel's query tiles (their blocks take
/// `HOPPER_ROWS` queries or keys).
const HOPPER_BACKWARD_TILE: usize = 64;

/// The Hopper dq kernel's dynamic shared memory: alignment, Q and dout of the block's queries,
/// two stages of K and V tiles.
fn hopper_dq_shared(hd: usize) -> usize {
    1024 + 2 * HOPPER_ROWS * hd * 2 + 4 * HOPPER_BACKWARD_TILE * hd * 2
}

/// The Hopper dk/dv kernel's: alignment, K and V of the block's keys, two stages of Q, dout,
/// lse and D, each rounded up to the swizzle's 1,024 bytes.
fn hopper_dkv_shared(hd: usize) -> usize {
    let stage = 2 * HOPPER_BACKWARD_TILE * hd * 2 + 2 * HOPPER_BACKWARD_TILE * 4;
    1024 + 2 * HOPPER_ROWS * hd * 2 + 2 * stage.next_multiple_of(1024)
}

/// The tensor-core kernels for this head size, when the views allow them.
fn flash(hd: usize, ptrs: &[u64]) -> Option<&'static Flash> {
    if ptrs.iter().any(|p| p % 16 != 0) {
        return None;
    }
    FLASH.iter().find(|f| f.hd == hd)
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
    /// 0 for no soft-cap.
    cap: f32,
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
            scale: shape.softmax_scale(),
            cap: shape.softcap.unwrap_or(0.0),
        })
    }

    /// The scalar kernels' backward arguments (`attention_backward_dq_*`, `_dkv_*`), which
    /// take the tensor-core kernels' and add the head size and the soft-cap.
    fn scalar_backward(&self, k: kernel::flash_backward) -> kernel::attention_backward {
        kernel::attention_backward {
            dqkv: k.dqkv,
            dout: k.dout,
            qkv: k.qkv,
            lse: k.lse,
            dsum: k.dsum,
            cu: k.cu,
            docs: k.docs,
            T: k.T,
            nq: k.nq,
            nkv: k.nkv,
            hd: self.hd,
            window: k.window,
            scale: k.scale,
            cap: self.cap,
        }
    }

    /// The scalar kernels' size bucket, as named: `_capped_` ones soft-cap the scores.
    fn scalar_name(&self, hd: usize) -> String {
        if self.cap > 0.0 { format!("capped_{hd}") } else { hd.to_string() }
    }
}

/// The scalar kernels' launch: 128 threads, static shared memory.
fn scalar_config(blocks: usize, heads: usize) -> LaunchConfig {
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

    /// The Hopper forward kernel for `shape` (no soft-cap, views aligned to 16 bytes) when it
    /// is on, the device is sm_90, the head size has one and the block gets its shared memory.
    fn hopper_forward(&self, shape: &AttentionShape) -> Option<&'static str> {
        let (_, name) = HOPPER_FORWARD.iter().find(|(hd, _)| *hd == shape.head_dim)?;
        let on = self.hopper_attention_forward()
            && self.arch() == "sm_90"
            && shape.softcap.is_none()
            && hopper_forward_shared(shape.head_dim) <= self.shared_optin;
        on.then_some(*name)
    }

    /// The Hopper backward kernels (dq, dk/dv) for `shape` (no soft-cap, views aligned to 16
    /// bytes) when they are on, the device is sm_90, the head size has them and their blocks
    /// get their shared memory.
    fn hopper_backward(&self, shape: &AttentionShape) -> Option<(&'static str, &'static str)> {
        let hd = shape.head_dim;
        let (_, dq, dkv) = HOPPER_BACKWARD.iter().find(|(size, _, _)| *size == hd)?;
        let on = self.hopper_attention_backward()
            && self.arch() == "sm_90"
            && shape.softcap.is_none()
            && hopper_dq_shared(hd).max(hopper_dkv_shared(hd)) <= self.shared_optin;
        on.then_some((*dq, *dkv))
    }

    /// Whether `attention_backward` of `shape`, on views aligned to 16 bytes, runs the Hopper
    /// kernels (see [`Cuda::set_hopper_attention_backward`]).
    pub fn hopper_attention_backward_for(&self, shape: &AttentionShape) -> bool {
        self.hopper_backward(shape).is_some()
    }

    /// Whether `attention_forward` of `shape`, on views aligned to 16 bytes, runs the Hopper
    /// kernel (see [`Cuda::set_hopper_attention_forward`]).
    pub fn hopper_attention_forward_for(&self, shape: &AttentionShape) -> bool {
        self.hopper_forward(shape).is_some()
    }

    /// Whether `attention_backward` of `shape`, on views aligned to 16 bytes, runs the fused
    /// kernel (see [`Cuda::set_fused_attention_backward`]).
    pub fn fused_attention_backward_for(&self, shape: &AttentionShape) -> bool {
        shape.softcap.is_none()
            && FLASH
                .iter()
                .find(|f| f.hd == shape.head_dim)
                .is_some_and(|f| self.fused_backward(f, shape).is_some())
    }

    /// The fused backward kernel for this shape, when it is on, the head size has one, the
    /// device gives a block its shared memory and the grid fits a launch.
    fn fused_backward(&self, f: &Flash, shape: &AttentionShape) -> Option<Tiles> {
        let k = f.fused?;
        let on = self.fused_attention_backward.load(std::sync::atomic::Ordering::Relaxed);
        let fits = f.fused_shared(&k) + FUSED_STATIC_SHARED <= self.shared_optin;
        let blocks = shape.tokens.div_ceil(k.rows()).checked_mul(shape.q_heads)?;
        (on && fits && blocks <= i32::MAX as usize).then_some(k)
    }

    /// dq, dk and dv in one launch of `k` (after `attention_backward_dot`): `args` are the
    /// split kernels' (dqkv first), to which it adds its f32 running sums and its counters.
    fn attention_backward_fused(
        &self,
        f: &Flash,
        k: &Tiles,
        args: kernel::flash_backward,
        shape: &AttentionShape,
    ) -> Result<()> {
        let (t, nq, nkv) = (shape.tokens, shape.q_heads, shape.kv_heads);
        let (key_blocks, query_tiles) = (t.div_ceil(k.rows()), t.div_ceil(k.tile));
        // Every element the kernel reads it stored first: no initialisation.
        let acc = scratch::<f32>(&self.compute, t * shape.qkv_width())?;
        // The ticket (padded to 16 bytes), then a counter per (query head, query tile), each
        // head's starting on 16 bytes, and one per (kv head, key block).
        let counters = 4 + nq * query_tiles.next_multiple_of(4) + nkv * key_blocks;
        let sync = scratch::<i32>(&self.compute, counters)?;
        let sync_ptr = base_ptr(&sync, &self.compute);
        self.bind()?;
        // SAFETY: `sync` holds `counters` i32s, all of which are zeroed on the compute stream
        // before the kernel that reads them.
        super::device::drv("zeroing the attention counters", unsafe {
            cudarc::driver::result::memset_d8_async(
                sync_ptr,
                0,
                counters * 4,
                self.compute.cu_stream(),
            )
        })?;
        // The split kernels' arguments with the f32 accumulators and the counters after dqkv.
        let fused = kernel::flash_backward_fused {
            dqkv: args.dqkv,
            acc: base_ptr(&acc, &self.compute),
            sync: sync_ptr,
            dout: args.dout,
            qkv: args.qkv,
            lse: args.lse,
            dsum: args.dsum,
            cu: args.cu,
            docs: args.docs,
            T: args.T,
            nq: args.nq,
            nkv: args.nkv,
            window: args.window,
            scale: args.scale,
        };
        let cfg = LaunchConfig {
            grid_dim: ((key_blocks * nq) as u32, 1, 1),
            block_dim: (32 * k.warps as u32, 1, 1),
            shared_mem_bytes: f.fused_shared(k) as u32,
        };
        self.launch_as(k.name, cfg, fused)
    }
}

impl AttentionOps for Cuda {
    fn attention_forward(
        &self,
        att: AttentionOut<ViewMut<'_>>,
        qkv: View<'_>,
        cu: &Ints,
        shape: &AttentionShape,
    ) -> Result<()> {
        let _t = self.timed(
            "attention_forward",
            OpClass::Attention,
            profile::attention_flops(&cu.host, shape.q_heads, shape.head_dim, shape.window),
        );
        const OP: &str = "attention_forward";
        let (s, hd, qw) = self.attention_common(OP, &qkv, cu, shape)?;
        let (o, l) = (att.out.as_view(), att.lse.as_view());
        check::len(OP, "out", o.len, &[shape.tokens, shape.q_heads, shape.head_dim])?;
        check::len(OP, "lse", l.len, &[shape.tokens, shape.q_heads])?;
        check::kind(OP, "out", &o, FloatKind::Activation)?;
        check::kind(OP, "lse", &l, FloatKind::Accum)?;
        let (t, nq) = (shape.tokens, shape.q_heads);
        // The tensor-core kernels have no soft-cap: a capped attention takes the scalar ones.
        let flash = if shape.softcap.is_some() {
            None
        } else {
            flash(shape.head_dim, &[self.ptr(&o), self.ptr(&qkv)])
        };
        if let Some(f) = flash {
            let args = kernel::flash_forward {
                out: self.ptr(&o),
                lse: self.ptr(&l),
                qkv: self.ptr(&qkv),
                cu: self.ints_ptr(cu),
                docs: s.docs,
                T: s.tokens,
                nq: s.nq,
                nkv: s.nkv,
                window: s.window,
                scale: s.scale,
            };
            if let Some(name) = self.hopper_forward(shape) {
                let cfg = LaunchConfig {
                    grid_dim: (t.div_ceil(HOPPER_ROWS) as u32, nq as u32, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: hopper_forward_shared(shape.head_dim) as u32,
                };
                return self.launch_as(name, cfg, args);
            }
            let k = &f.forward;
            return self.launch_as(
                k.name,
                k.config(t.div_ceil(k.rows()), nq, f.forward_shared()),
                args,
            );
        }
        let args = kernel::attention_forward {
            out: self.ptr(&o),
            lse: self.ptr(&l),
            qkv: self.ptr(&qkv),
            cu: self.ints_ptr(cu),
            docs: s.docs,
            T: s.tokens,
            nq: s.nq,
            nkv: s.nkv,
            hd: s.hd,
            window: s.window,
            scale: s.scale,
            cap: s.cap,
        };
        let name = format!("attention_forward_{}", s.scalar_name(hd));
        self.launch_as(&name, scalar_config(t.div_ceil(4 * qw), nq), args)
    }

    fn attention_backward(
        &self,
        dqkv: ViewMut<'_>,
        dout: View<'_>,
        qkv: View<'_>,
        att: AttentionOut<View<'_>>,
        cu: &Ints,
        shape: &AttentionShape,
    ) -> Result<()> {
        let _t = self.timed(
            "attention_backward",
            OpClass::Attention,
            2.5 * profile::attention_flops(&cu.host, shape.q_heads, shape.head_dim, shape.window),
        );
        const OP: &str = "attention_backward";
        let AttentionOut { out, lse } = att;
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
            LaunchConfig {
                grid_dim: ((t * nq).div_ceil(4) as u32, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            },
            kernel::attention_backward_dot {
                dsum: dsum_ptr,
                dout: self.ptr(&dout),
                out: self.ptr(&out),
                rows: (t * nq) as i64,
                hd: s.hd,
            },
        )?;
        let args = kernel::flash_backward {
            dqkv: self.ptr(&d),
            dout: self.ptr(&dout),
            qkv: self.ptr(&qkv),
            lse: self.ptr(&lse),
            dsum: dsum_ptr,
            cu: self.ints_ptr(cu),
            docs: s.docs,
            T: s.tokens,
            nq: s.nq,
            nkv: s.nkv,
            window: s.window,
            scale: s.scale,
        };
        let pointers = [self.ptr(&d), self.ptr(&dout), self.ptr(&qkv)];
        let flash = if shape.softcap.is_some() { None } else { flash(shape.head_dim, &pointers) };
        if let Some(f) = flash {
            if let Some((dq, dkv)) = self.hopper_backward(shape) {
                let hd = shape.head_dim;
                let cfg = |heads: usize, shared: usize| LaunchConfig {
                    grid_dim: (t.div_ceil(HOPPER_ROWS) as u32, heads as u32, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: shared as u32,
                };
                self.launch_as(dq, cfg(nq, hopper_dq_shared(hd)), args)?;
                return self.launch_as(dkv, cfg(shape.kv_heads, hopper_dkv_shared(hd)), args);
            }
            if let Some(k) = self.fused_backward(f, shape) {
                return self.attention_backward_fused(f, &k, args, shape);
            }
            let k = &f.dq;
            self.launch_as(k.name, k.config(t.div_ceil(k.rows()), nq, f.dq_shared()), args)?;
            for (k, writes_dk) in f.dkv {
                let shared = f.dkv_shared(k, *writes_dk);
                self.launch_as(
                    k.name,
                    k.config(t.div_ceil(k.rows()), shape.kv_heads, shared),
                    args,
                )?;
            }
            return Ok(());
        }
        let args = s.scalar_backward(args);
        let blocks = t.div_ceil(4 * qw);
        let name = s.scalar_name(hd);
        self.launch_as(&format!("attention_backward_dq_{name}"), scalar_config(blocks, nq), args)?;
        self.launch_as(
            &format!("attention_backward_dkv_{name}"),
            scalar_config(blocks, shape.kv_heads),
            args,
        )
    }

    fn attention_decode(
        &self,
        out: ViewMut<'_>,
        q: View<'_>,
        k_cache: View<'_>,
        v_cache: View<'_>,
        sinks: Option<View<'_>>,
        shape: &DecodeShape,
    ) -> Result<()> {
        let _t = self.timed("attention_decode", OpClass::Attention, 0.0);
        self.decode(out, q, k_cache, v_cache, sinks, shape)
    }

    /// GPT-OSS's sinks on `attention_forward`'s out and lse, one warp per (token, head).
    fn attention_sinks_forward(
        &self,
        att: AttentionOut<ViewMut<'_>>,
        sinks: View<'_>,
        shape: &AttentionShape,
    ) -> Result<()> {
        let _t = self.timed("attention_sinks_forward", OpClass::Attention, 0.0);
        const OP: &str = "attention_sinks_forward";
        let (t, nq, hd) = (shape.tokens, shape.q_heads, shape.head_dim);
        let (o, l) = (att.out.as_view(), att.lse.as_view());
        check::len(OP, "out", o.len, &[t, nq, hd])?;
        check::len(OP, "lse", l.len, &[t, nq])?;
        check::len(OP, "sinks", sinks.len, &[nq])?;
        check::kind(OP, "out", &o, FloatKind::Activation)?;
        check::kind(OP, "lse", &l, FloatKind::Accum)?;
        // As the CPU twin: with no head elements there is nothing to rescale, lse included.
        if nq == 0 || hd == 0 {
            return Ok(());
        }
        let rows = t * nq;
        let blocks = check::int(OP, "tokens x q_heads / 8", rows.div_ceil(SINK_WARPS))?;
        self.launch(
            LaunchConfig {
                grid_dim: (blocks as u32, 1, 1),
                block_dim: (32 * SINK_WARPS as u32, 1, 1),
                shared_mem_bytes: 0,
            },
            kernel::attention_sinks_forward {
                out: self.ptr(&o),
                lse: self.ptr(&l),
                sinks: self.ptr(&sinks),
                sinks_f32: sinks.is_f32(),
                rows: rows as i64,
                nq: check::int(OP, "q_heads", nq)?,
                hd: check::int(OP, "head_dim", hd)?,
            },
        )
    }

    /// The sinks' gradient: per-head partial sums over fixed chunks of tokens, then the chunks
    /// in order (`finish_columns`), so the sum over tokens is deterministic.
    fn attention_sinks_backward(
        &self,
        dsinks: ViewMut<'_>,
        dout: View<'_>,
        att: AttentionOut<View<'_>>,
        sinks: View<'_>,
        shape: &AttentionShape,
    ) -> Result<()> {
        let _t = self.timed("attention_sinks_backward", OpClass::Attention, 0.0);
        const OP: &str = "attention_sinks_backward";
        let AttentionOut { out, lse } = att;
        let (t, nq, hd) = (shape.tokens, shape.q_heads, shape.head_dim);
        check::len(OP, "dsinks", dsinks.len, &[nq])?;
        check::len(OP, "dout", dout.len, &[t, nq, hd])?;
        check::len(OP, "out", out.len, &[t, nq, hd])?;
        check::len(OP, "lse", lse.len, &[t, nq])?;
        check::len(OP, "sinks", sinks.len, &[nq])?;
        check::kind(OP, "dout", &dout, FloatKind::Activation)?;
        check::kind(OP, "out", &out, FloatKind::Activation)?;
        check::kind(OP, "lse", &lse, FloatKind::Accum)?;
        if t == 0 || nq == 0 || hd == 0 {
            return Ok(());
        }
        if nq > 65535 {
            return Err(check::err(OP, format!("{nq} query heads exceed the grid's 65535")));
        }
        let rows_per = t.div_ceil(COLUMN_CHUNKS.min(t));
        let chunks = t.div_ceil(rows_per);
        let partials = scratch::<f32>(&self.compute, chunks * nq)?;
        let pp = base_ptr(&partials, &self.compute);
        self.launch(
            LaunchConfig {
                grid_dim: (chunks as u32, nq as u32, 1),
                block_dim: (32 * SINK_WARPS as u32, 1, 1),
                shared_mem_bytes: 0,
            },
            kernel::attention_sinks_backward {
                partials: pp,
                dout: self.ptr(&dout),
                out: self.ptr(&out),
                lse: self.ptr(&lse),
                sinks: self.ptr(&sinks),
                sinks_f32: sinks.is_f32(),
                tokens: t as i64,
                rows_per: rows_per as i64,
                nq: nq as i32,
                hd: check::int(OP, "head_dim", hd)?,
            },
        )?;
        self.finish_columns(&dsinks, pp, chunks, nq)
    }
}

/// Warps per block of the sink kernels.
const SINK_WARPS: usize = 8;

#[cfg(test)]
mod tests {
    use super::*;

    /// The numbers after the kernel name in each instantiation line of the source.
    fn instantiations(macro_name: &str) -> Vec<Vec<String>> {
        include_str!("kernels/attention.cu")
            .lines()
            .filter_map(|l| l.strip_prefix(&format!("{macro_name}(")))
            .map(|l| l.trim_end_matches(')').split(", ").map(str::to_string).collect())
            .collect()
    }

    #[test]
    fn tile_table_matches_the_kernel_instantiations() {
        let flash = instantiations("FLASH_ENTRY_POINTS");
        assert_eq!(flash.len(), FLASH.len());
        for (f, line) in FLASH.iter().zip(&flash) {
            let n = |i: usize| line[i].parse::<usize>().expect("number");
            assert_eq!(n(0), f.hd);
            assert_eq!(f.forward.name, format!("flash_forward_{}", f.hd));
            assert_eq!((f.forward.warps, f.forward.tile, f.forward.stages), (n(1), n(2), n(3)));
            assert_eq!(f.dq.name, format!("flash_backward_dq_{}", f.hd));
            assert_eq!((f.dq.warps, f.dq.tile, f.dq.stages), (n(4), n(5), n(6)));
        }
        let dkv = instantiations("FLASH_DKV_ENTRY_POINT");
        let table: Vec<_> =
            FLASH.iter().flat_map(|f| f.dkv.iter().map(move |k| (f.hd, k))).collect();
        assert_eq!(dkv.len(), table.len());
        for ((hd, (k, writes_dk)), line) in table.iter().zip(&dkv) {
            let n = |i: usize| line[i].parse::<usize>().expect("number");
            assert_eq!(line[0], k.name);
            assert_eq!((n(1), n(2), n(3), n(4)), (*hd, k.warps, k.tile, k.stages), "{}", k.name);
            // MODE: 1 writes dv, 2 dk, 3 both.
            assert_eq!(n(5) & 2 != 0, *writes_dk, "{}", k.name);
        }
        let fused = instantiations("FLASH_FUSED_ENTRY_POINT");
        let table: Vec<_> = FLASH.iter().filter_map(|f| f.fused.map(|k| (f.hd, k))).collect();
        assert_eq!(fused.len(), table.len());
        for ((hd, k), line) in table.iter().zip(&fused) {
            let n = |i: usize| line[i].parse::<usize>().expect("number");
            assert_eq!(k.name, format!("flash_backward_fused_{hd}"));
            // Two stages, built into the kernel.
            assert_eq!((n(0), n(1), n(2), 2), (*hd, k.warps, k.tile, k.stages), "{}", k.name);
        }
    }

    #[test]
    fn every_tensor_core_kernel_fits_the_shared_memory_of_sm_86() {
        const SM86_MAX: usize = 99 * 1024;
        for f in &FLASH {
            assert!(f.forward_shared() <= SM86_MAX, "{}", f.forward.name);
            assert!(f.dq_shared() <= SM86_MAX, "{}", f.dq.name);
            for (k, writes_dk) in f.dkv {
                assert!(f.dkv_shared(k, *writes_dk) <= SM86_MAX, "{}", k.name);
            }
        }
    }

    /// The layout the kernel's comment gives, summed by hand at head size 128: K and V
    /// 2 x 128 x 136 x 2, two stages of Q, dout, lse and D 2 x (2 x 32 x 136 x 2 + 2 x 32 x 4),
    /// dS 32 x 136 x 2, the running dq of two tiles 2 x 32 x 136 x 4: 145 KiB, within sm_80's
    /// 163 KiB and sm_90's 227 KiB, beyond sm_86's and sm_89's 99 KiB (which then take the
    /// split kernels).
    #[test]
    fn the_fused_backward_fits_sm_80_and_sm_90_only_at_head_size_128() {
        let f = FLASH.iter().find(|f| f.hd == 128).expect("128");
        let k = f.fused.expect("fused 128");
        let by_hand = 2 * 128 * 136 * 2 + 2 * (2 * 32 * 136 * 2 + 2 * 32 * 4) + 32 * 136 * 2;
        assert_eq!(f.fused_shared(&k), by_hand + 2 * 32 * 136 * 4);
        assert_eq!(f.fused_shared(&k), 145 * 1024);
        let need = f.fused_shared(&k) + FUSED_STATIC_SHARED;
        assert!(need <= 163 * 1024 && need > 99 * 1024);
        let f64 = FLASH.iter().find(|f| f.hd == 64).expect("64");
        assert!(f64.fused_shared(&f64.fused.expect("fused 64")) + FUSED_STATIC_SHARED <= 99 * 1024);
    }

    /// The Hopper forward's table names the kernels the source instantiates, and its shared
    /// memory, summed by hand (1,024 to align, Q 128 x 128 x 2, two stages of K and V
    /// 4 x 128 x 128 x 2: 161 KiB at head size 128), fits sm_90's 227 KiB; the output stage
    /// (128 rows of 136 bf16) fits the two K buffers it reuses.
    #[test]
    fn the_hopper_forward_table_matches_its_instantiations_and_fits_sm_90() {
        let lines = instantiations("HOPPER_FORWARD_ENTRY_POINT");
        let sizes: Vec<usize> =
            lines.iter().map(|l| l[0].parse::<usize>().expect("number")).collect();
        assert_eq!(sizes, HOPPER_FORWARD.iter().map(|(hd, _)| *hd).collect::<Vec<_>>());
        for (hd, name) in HOPPER_FORWARD {
            assert_eq!(name, format!("hopper_forward_{hd}"));
            assert!(hopper_forward_shared(hd) <= 227 * 1024, "{name}");
            assert!(HOPPER_ROWS * (hd + 8) * 2 <= 2 * HOPPER_ROWS * hd * 2, "{name}: output stage");
        }
        assert_eq!(hopper_forward_shared(128), 1024 + 128 * 128 * 2 + 4 * 128 * 128 * 2);
        assert_eq!(hopper_forward_shared(128), 161 * 1024);
    }

    /// Likewise the backward: dq 1,024 + Q and dout 2 x 128 x 128 x 2 + K and V stages
    /// 4 x 64 x 128 x 2 (129 KiB at head size 128); dk/dv 1,024 + K and V 2 x 128 x 128 x 2 +
    /// two stages of Q and dout 2 x 64 x 128 x 2 and lse and D 2 x 64 x 4, each stage rounded to
    /// 33 KiB (131 KiB). The output stages (128 rows of 136 bf16) fit from the K buffers to
    /// the end of the K and V tiles they reuse.
    #[test]
    fn the_hopper_backward_table_matches_its_instantiations_and_fits_sm_90() {
        let lines = instantiations("HOPPER_BACKWARD_ENTRY_POINTS");
        assert_eq!(lines.len(), HOPPER_BACKWARD.len());
        for ((hd, dq, dkv), line) in HOPPER_BACKWARD.iter().zip(&lines) {
            let n = |i: usize| line[i].parse::<usize>().expect("number");
            assert_eq!((n(0), n(1)), (*hd, HOPPER_BACKWARD_TILE));
            assert_eq!(*dq, format!("hopper_backward_dq_{hd}"));
            assert_eq!(*dkv, format!("hopper_backward_dkv_{hd}"));
            assert!(hopper_dq_shared(*hd).max(hopper_dkv_shared(*hd)) <= 227 * 1024, "{dq}");
            let stage = HOPPER_ROWS * (hd + 8) * 2;
            assert!(stage <= 4 * HOPPER_BACKWARD_TILE * hd * 2, "{dq}: output stage");
            assert!(stage <= 2 * HOPPER_ROWS * hd * 2, "{dkv}: output stage");
        }
        assert_eq!(hopper_dq_shared(128), 129 * 1024);
        assert_eq!(hopper_dkv_shared(128), 1024 + 2 * 128 * 128 * 2 + 2 * 33 * 1024);
        assert_eq!(hopper_dkv_shared(128), 131 * 1024);
    }

    #[test]
    fn misaligned_views_take_the_scalar_kernels() {
        assert!(flash(128, &[0x1000, 0x2010]).is_some());
        assert!(flash(128, &[0x1000, 0x2006]).is_none());
        assert!(flash(112, &[0x1000]).is_none());
    }
}
