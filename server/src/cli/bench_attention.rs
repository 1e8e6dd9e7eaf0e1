//! `sluice bench attention`: the fused attention kernels alone, forward and backward, on one
//! GPU at a training shape (one packed micro-batch of `--docs` equal documents), with TFLOPS by
//! the causal count FlashAttention reports: 4 x head_dim x query heads x (query, key) pairs
//! for the forward (two products), 2.5 times that for the backward (five products). The
//! forward runs on the mma.sync kernels, on the Hopper ones (sm_90) or, by default, on both;
//! the backward on the split kernels (dq, then dk and dv: seven products), on the fused one
//! (five), on the Hopper ones (the split kernels' products on warpgroup MMAs) or, by default,
//! on each in turn, with the time of each against the split kernels'.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sluice_engine::backend::cuda::Cuda;
use sluice_engine::backend::{AttentionOps, AttentionOut, AttentionShape, FloatKind};
// The device side (buffers, transfers) of the concrete backend, by its trait alone: `Device`
// here is the subcommand's.
use sluice_engine::backend::Device as _;
use sluice_engine::plan::sizes::causal_pairs;

use super::device::Device;

#[derive(Debug, clap::Args)]
pub(crate) struct AttentionArgs {
    /// Tokens in the micro-batch.
    #[arg(long, default_value_t = 32768)]
    tokens: usize,

    /// Equal documents the tokens are packed from (the mask is causal within each).
    #[arg(long, default_value_t = 1)]
    docs: usize,

    /// Query heads (Qwen2.5-7B: 28).
    #[arg(long, default_value_t = 28)]
    q_heads: usize,

    /// Key/value heads (Qwen2.5-7B: 4).
    #[arg(long, default_value_t = 4)]
    kv_heads: usize,

    #[arg(long, default_value_t = 128)]
    head_dim: usize,

    /// Sliding window in tokens [default: none].
    #[arg(long)]
    window: Option<usize>,

    /// Timed runs of each direction; the figure is their median.
    #[arg(long, default_value_t = 10)]
    iters: usize,

    /// Which forward kernels to time.
    #[arg(long, value_enum, default_value_t = ForwardKernels::Both)]
    forward: ForwardKernels,

    /// Which backward kernels to time.
    #[arg(long, value_enum, default_value_t = BackwardKernels::All)]
    backward: BackwardKernels,

    #[arg(long, default_value = "cuda:0")]
    device: Device,
}

/// The attention forward's implementations on the tensor cores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum ForwardKernels {
    /// mma.sync, every architecture (training's elsewhere, or on sm_90 with
    /// `SLUICE_ATTENTION_FORWARD=mma`).
    Mma,
    /// Warpgroup MMAs, sm_90 only (training's default there).
    Hopper,
    /// mma.sync, then Hopper, and their ratio.
    Both,
}

/// The attention backward's implementations on the tensor cores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum BackwardKernels {
    /// The dq kernel, then the dk/dv kernel (training's default off sm_90, or on it with
    /// `SLUICE_ATTENTION_BACKWARD=split`).
    Split,
    /// One kernel for dq, dk and dv (`SLUICE_ATTENTION_BACKWARD=fused` in training).
    Fused,
    /// The split kernels on warpgroup MMAs, sm_90 only (training's default there).
    Hopper,
    /// Each of the above, and its time against the split kernels'.
    All,
}

/// Most tokens a measured micro-batch may have (the trainer's longest row).
const MAX_TOKENS: usize = 1 << 20;

/// Refuses shapes the kernels do not take, before any memory is touched.
fn validate(a: &AttentionArgs) -> anyhow::Result<()> {
    if a.tokens == 0 || a.tokens > MAX_TOKENS {
        bail!("--tokens must be between 1 and {MAX_TOKENS}, got {}", a.tokens);
    }
    if a.docs == 0 || !a.tokens.is_multiple_of(a.docs) {
        bail!("--docs {} must be at least 1 and divide --tokens {}", a.docs, a.tokens);
    }
    if a.q_heads == 0
        || a.kv_heads == 0
        || !a.q_heads.is_multiple_of(a.kv_heads)
        || a.q_heads > 1024
    {
        bail!(
            "--q-heads {} must be a multiple of --kv-heads {} (both at least 1, at most 1024 \
             query heads)",
            a.q_heads,
            a.kv_heads
        );
    }
    if a.head_dim == 0 || a.head_dim > 256 {
        bail!("--head-dim must be between 1 and 256, got {}", a.head_dim);
    }
    if a.window == Some(0) {
        bail!("--window must be at least 1 token");
    }
    if a.iters == 0 || a.iters > 1000 {
        bail!("--iters must be between 1 and 1000, got {}", a.iters);
    }
    Ok(())
}

pub(crate) fn run(a: AttentionArgs) -> anyhow::Result<()> {
    let Device::Cuda(ordinal) = a.device else {
        bail!("--device {}: this measures the GPU kernels; name a GPU (cuda:N)", a.device)
    };
    validate(&a)?;
    let cuda = Cuda::new(ordinal).context("cannot use the GPU")?;
    let shape = AttentionShape {
        tokens: a.tokens,
        q_heads: a.q_heads,
        kv_heads: a.kv_heads,
        head_dim: a.head_dim,
        docs: a.docs,
        window: a.window,
        scale_dim: None,
        softcap: None,
    };
    let (t, nq, hd) = (a.tokens, a.q_heads, a.head_dim);
    let len = t / a.docs;
    let cu: Vec<i32> = (0..=a.docs)
        .map(|d| i32::try_from(d * len).context("--tokens exceeds the kernels' 32-bit sizes"))
        .collect::<anyhow::Result<_>>()?;

    let mut rng = StdRng::seed_from_u64(0);
    // Uniform in [-2, 2), uploaded a piece at a time so host memory stays small.
    let mut random = |n: usize, kind: FloatKind| -> anyhow::Result<_> {
        const PIECE: usize = 1 << 24;
        let mut buf = cuda.alloc(n, kind)?;
        for start in (0..n).step_by(PIECE) {
            let end = (start + PIECE).min(n);
            let host: Vec<f32> = (start..end).map(|_| rng.random_range(-2.0f32..2.0)).collect();
            cuda.upload(cuda.view_mut(&mut buf, start..end), &host)?;
        }
        Ok(buf)
    };
    let width = shape.qkv_width();
    let qkv = random(t * width, FloatKind::Activation)?;
    let dout = random(t * nq * hd, FloatKind::Activation)?;
    let mut out = cuda.alloc(t * nq * hd, FloatKind::Activation)?;
    let mut lse = cuda.alloc(t * nq, FloatKind::Accum)?;
    let mut dqkv = cuda.alloc(t * width, FloatKind::Activation)?;
    let mut cu_d = cuda.alloc_ints(cu.len())?;
    cuda.upload_ints(&mut cu_d, &cu)?;

    let mut forward = || -> anyhow::Result<()> {
        let att = AttentionOut {
            out: cuda.view_mut(&mut out, 0..t * nq * hd),
            lse: cuda.view_mut(&mut lse, 0..t * nq),
        };
        cuda.attention_forward(att, cuda.view(&qkv, 0..t * width), &cu_d, &shape)?;
        Ok(())
    };
    let mut fwd = Vec::new();
    for (kernels, hopper) in [(ForwardKernels::Mma, false), (ForwardKernels::Hopper, true)] {
        if a.forward != kernels && a.forward != ForwardKernels::Both {
            continue;
        }
        cuda.set_hopper_attention_forward(hopper);
        if hopper && !cuda.hopper_attention_forward_for(&shape) {
            if a.forward == ForwardKernels::Hopper {
                bail!(
                    "the Hopper forward does not run at head_dim {hd} on {} (head_dim 64 or 128 \
                     on sm_90)",
                    cuda.arch()
                );
            }
            println!("(the Hopper forward does not run at head_dim {hd} on {})", cuda.arch());
            continue;
        }
        fwd.push((if hopper { "hopper" } else { "mma" }, time(a.iters, &cuda, &mut forward)?));
    }
    let mut backward = || -> anyhow::Result<()> {
        let att =
            AttentionOut { out: cuda.view(&out, 0..t * nq * hd), lse: cuda.view(&lse, 0..t * nq) };
        cuda.attention_backward(
            cuda.view_mut(&mut dqkv, 0..t * width),
            cuda.view(&dout, 0..t * nq * hd),
            cuda.view(&qkv, 0..t * width),
            att,
            &cu_d,
            &shape,
        )?;
        Ok(())
    };
    let mut bwd = Vec::new();
    for kernels in [BackwardKernels::Split, BackwardKernels::Fused, BackwardKernels::Hopper] {
        if a.backward != kernels && a.backward != BackwardKernels::All {
            continue;
        }
        let (fused, hopper) =
            (kernels == BackwardKernels::Fused, kernels == BackwardKernels::Hopper);
        cuda.set_fused_attention_backward(fused);
        cuda.set_hopper_attention_backward(hopper);
        let (runs, needs) = if fused {
            (
                cuda.fused_attention_backward_for(&shape),
                "head_dim 64 or 128, and the shared memory of sm_80 or sm_90 at 128",
            )
        } else if hopper {
            (cuda.hopper_attention_backward_for(&shape), "head_dim 64 or 128 on sm_90")
        } else {
            (true, "")
        };
        let name = if fused {
            "fused"
        } else if hopper {
            "hopper"
        } else {
            "split"
        };
        if !runs {
            if a.backward == kernels {
                bail!(
                    "the {name} backward does not run at head_dim {hd} on {} ({needs})",
                    cuda.arch()
                );
            }
            println!("(the {name} backward does not run at head_dim {hd} on {})", cuda.arch());
            continue;
        }
        bwd.push((name, time(a.iters, &cuda, &mut backward)?));
    }

    // (query, key) pairs the mask lets through, per head.
    let pairs = causal_pairs(len as u64, a.window.map(|w| w as u64)) * a.docs as u64;
    let fwd_flops = 4.0 * hd as f64 * nq as f64 * pairs as f64;
    let tflops = |flops: f64, d: Duration| flops / d.as_secs_f64() / 1e12;
    println!(
        "attention on {}: {t} tokens in {} documents, {nq} query heads, {} kv heads, head_dim \
         {hd}, window {}; medians of {} runs",
        cuda.arch(),
        a.docs,
        a.kv_heads,
        a.window.map_or("none".into(), |w| w.to_string()),
        a.iters
    );
    for (kernels, d) in &fwd {
        println!(
            "forward  {:>9.3} ms  {:>6.1} TFLOPS  ({kernels})",
            d.as_secs_f64() * 1e3,
            tflops(fwd_flops, *d)
        );
    }
    for (kernels, d) in &bwd {
        println!(
            "backward {:>9.3} ms  {:>6.1} TFLOPS  ({kernels})",
            d.as_secs_f64() * 1e3,
            tflops(2.5 * fwd_flops, *d)
        );
    }
    if let [(_, mma), (_, hopper)] = fwd[..] {
        println!("hopper / mma forward time: {:.3}", hopper.as_secs_f64() / mma.as_secs_f64());
    }
    if let [("split", split), ref others @ ..] = bwd[..] {
        for (name, d) in others {
            println!("{name} / split backward time: {:.3}", d.as_secs_f64() / split.as_secs_f64());
        }
    }
    Ok(())
}

/// Median device time of `iters` runs of `f`, after one untimed run.
fn time(
    iters: usize,
    cuda: &Cuda,
    f: &mut dyn FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<Duration> {
    f()?;
    cuda.synchronize()?;
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        let start = Instant::now();
        f()?;
        cuda.synchronize()?;
        times.push(start.elapsed());
    }
    Ok(median(times))
}

/// The middle of `times` (the upper middle for an even count); zero for none.
pub(super) fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times.get(times.len() / 2).copied().unwrap_or_default()
}
