//! Speeds at real shapes (printed, not checked) and the marks that time the compute stream's idle
//! time.

use crate::common::*;

/// Prints the forward and backward speed of causal attention at Qwen2.5-7B's heads (28 query
/// heads, 4 kv heads, head_dim 128) over `docs` packed documents of `seq` tokens. FLOPs: 4 s² hd
/// per head and document forward (QKᵀ and PV), halved by the causal mask; 2.5 times that
/// backward (QKᵀ, dP, dV, dK and dQ), as FlashAttention counts them.
pub(crate) fn attention_speed(docs: usize, seq: usize) {
    let g = gpu();
    let (nq, nkv, hd) = (28, 4, 128);
    let t = docs * seq;
    let shape = AttentionShape {
        tokens: t,
        q_heads: nq,
        kv_heads: nkv,
        head_dim: hd,
        docs,
        window: None,
        scale_dim: None,
        softcap: None,
    };
    let cu: Vec<i32> = (0..=docs).map(|d| (d * seq) as i32).collect();
    let cu = ints(g, &cu);
    let mut r = rng(60);
    let qkv = put(g, &uniform(&mut r, t * shape.qkv_width(), 1.0), Activation);
    let dout = put(g, &uniform(&mut r, t * nq * hd, 1.0), Activation);
    let (mut out, mut lse) = (nan(g, t * nq * hd, Activation), nan(g, t * nq, Accum));
    let mut dqkv = nan(g, t * shape.qkv_width(), Activation);
    let fwd = median_seconds(9, &mut || {
        let att = AttentionOut { out: all_mut(g, &mut out), lse: all_mut(g, &mut lse) };
        g.attention_forward(att, all(g, &qkv), &cu, &shape).expect("fwd")
    });
    let bwd = median_seconds(9, &mut || {
        g.attention_backward(
            all_mut(g, &mut dqkv),
            all(g, &dout),
            all(g, &qkv),
            AttentionOut { out: all(g, &out), lse: all(g, &lse) },
            &cu,
            &shape,
        )
        .expect("bwd")
    });
    let flops = docs as f64 * 4.0 * (seq * seq) as f64 * (hd * nq) as f64 / 2.0;
    println!(
        "attention {docs} x {seq} tokens, {nq}/{nkv} heads, hd {hd}, causal: forward {:.3} ms ({:.1} TFLOPS), backward {:.3} ms ({:.1} TFLOPS)",
        fwd * 1e3,
        flops / fwd / 1e12,
        bwd * 1e3,
        2.5 * flops / bwd / 1e12
    );
}

/// Not a parity check: the speed of the attention kernels and of a cuBLASLt GEMM at a
/// Qwen2.5-7B layer's shapes (8192 tokens per call), printed for planning.
#[test]
pub(crate) fn speed_at_7b_layer_shapes() {
    attention_speed(8, 1024);
    attention_speed(2, 4096);
    let g = gpu();
    let (t, h, inter) = (4096, 3584, 18944);
    let mut r = rng(61);
    let x = put(g, &uniform(&mut r, t * h, 1.0), Activation);
    let w = put(g, &uniform(&mut r, 2 * inter * h, 0.02), Activation);
    let mut y = nan(g, t * 2 * inter, Activation);
    let shape = MatmulShape { rows: t, k: h, n: 2 * inter };
    let mm = median_seconds(5, &mut || {
        let operands = Operands { inp: all(g, &x), w: all(g, &w) };
        g.matmul_forward(all_mut(g, &mut y), operands, &shape).expect("gemm")
    });
    println!(
        "GEMM [4096 x 3584] x [37888 x 3584]^T: {:.2} ms ({:.0} TFLOPS)",
        mm * 1e3,
        2.0 * (t * h * 2 * inter) as f64 / mm / 1e12
    );
}

/// `Device::elapsed` reads the compute stream's own time between two marks, which is how a
/// step reports the optimizer's exposed time: a host wait while the stream is idle counts
/// whole, one that work queued before it covers counts nothing.
#[test]
pub(crate) fn marks_time_the_compute_streams_idle_time_across_a_host_wait() {
    let g = gpu();
    let compute = g.compute_stream();
    let wait = std::time::Duration::from_millis(40);
    let across_wait = || {
        let a = g.mark(&compute).expect("mark");
        std::thread::sleep(wait);
        let b = g.mark(&compute).expect("mark");
        g.elapsed(&a, &b).expect("read the marks").expect("the GPU times its marks")
    };
    g.synchronize().expect("an idle stream");
    let idle = across_wait();
    assert!(idle >= wait * 9 / 10 && idle <= wait * 3, "idle stream: {idle:?} across {wait:?}");

    // About 0.3 s of GEMMs queued ahead of the first mark keep the stream busy through the wait.
    let (t, h, n) = (4096, 3584, 37888);
    let mut r = rng(67);
    let x = put(g, &uniform(&mut r, t * h, 1.0), Activation);
    let w = put(g, &uniform(&mut r, n * h, 0.02), Activation);
    let mut y = nan(g, t * n, Activation);
    let shape = MatmulShape { rows: t, k: h, n };
    let started = std::time::Instant::now();
    for _ in 0..200 {
        let operands = Operands { inp: all(g, &x), w: all(g, &w) };
        g.matmul_forward(all_mut(g, &mut y), operands, &shape).expect("gemm");
    }
    let covered = across_wait();
    g.synchronize().expect("the GEMMs");
    let busy = started.elapsed();
    assert!(busy > wait * 2, "the GEMMs took {busy:?}: too short to cover the wait");
    assert!(covered < std::time::Duration::from_millis(2), "busy stream: {covered:?} idle");
}
