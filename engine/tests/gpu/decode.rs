//! Generation: attention against the KV cache, and the KV-cached forward against the CPU and the
//! training forward.

use crate::common::*;
use crate::step::{config, golden_dir, spec_from};
use sluice_engine::backend::DecodeShape;
use sluice_engine::generate::{GenerateOptions, Generator};

/// `sinks`: GPT-OSS's per-head sink logits, in the softmax's denominator.
pub(crate) fn decode_case(
    hd: usize,
    nkv: usize,
    window: Option<usize>,
    past: usize,
    tokens: usize,
    sinks: bool,
) {
    let (g, c) = (gpu(), Cpu::new());
    let mut r = rng((hd * 1000 + past + tokens) as u64 + u64::from(sinks));
    let nq = 6;
    let shape = DecodeShape {
        past,
        tokens,
        q_heads: nq,
        kv_heads: nkv,
        head_dim: hd,
        window,
        scale_dim: None,
        softcap: None,
    };
    let n = (past + tokens) * nkv * hd;
    // Scaled up so some softmax rows are far from uniform.
    let q = round_bf16(&uniform(&mut r, tokens * nq * hd, 2.5));
    let k = round_bf16(&uniform(&mut r, n, 2.5));
    let v = round_bf16(&uniform(&mut r, n, 1.0));
    // Sinks around the scores' own size (up to ~6 here), so they take a real share.
    let sink: Vec<f32> =
        round_bf16(&uniform(&mut r, nq, 3.0).iter().map(|s| s + 2.0).collect::<Vec<_>>());
    let sink = sinks.then_some(sink);
    let mut want = vec![0.0; tokens * nq * hd];
    c.attention_decode(&mut want, &q, &k, &v, sink.as_deref(), &shape).expect("cpu");
    // The caches are the front of larger buffers, as in generation (room for more positions).
    let room = n + 9 * nkv * hd;
    let (mut kc, mut vc) = (nan(g, room, Activation), nan(g, room, Activation));
    g.upload(g.view_mut(&mut kc, 0..n), &k).expect("upload");
    g.upload(g.view_mut(&mut vc, 0..n), &v).expect("upload");
    let mut out = nan(g, tokens * nq * hd, Activation);
    let qd = put(g, &q, Activation);
    let sink_d = sink.as_ref().map(|s| put(g, s, Activation));
    g.attention_decode(
        all_mut(g, &mut out),
        all(g, &qd),
        g.view(&kc, 0..n),
        g.view(&vc, 0..n),
        sink_d.as_ref().map(|s| all(g, s)),
        &shape,
    )
    .expect("gpu");
    // f32 math and one bf16 rounding of the output; the GPU's online softmax rescales in another
    // order than the CPU's two passes (f32 ulps), and adds the sink to its denominator where the
    // CPU rescales its output after (the same quotient, formed in another order).
    let name = format!(
        "attention_decode hd={hd} nkv={nkv} window={window:?} past={past} n={tokens} \
         sinks={sinks}"
    );
    check(&name, &get(g, &out), &want, 5e-3);
}

#[test]
pub(crate) fn decode_attention_against_the_cpu() {
    decode_case(64, 2, None, 0, 37, false); // a whole prompt
    decode_case(64, 2, None, 300, 1, false); // one token after 300
    decode_case(128, 1, Some(40), 500, 1, false); // a window inside the cache
    decode_case(8, 2, None, 20, 3, false); // the golden models' head sizes
    decode_case(12, 3, Some(5), 30, 1, false);
    decode_case(256, 2, Some(100), 1000, 2, false);
    decode_case(96, 6, None, 2047, 1, false);
    decode_case(80, 3, Some(3000), 33, 4, false); // a window wider than the sequence
    // GPT-OSS's sinks (head_dim 64, sliding layers of 128): a prompt, then single tokens.
    decode_case(64, 2, None, 0, 37, true);
    decode_case(64, 1, Some(128), 300, 1, true);
    decode_case(64, 2, None, 1000, 2, true);
    decode_case(32, 3, Some(5), 30, 1, true);
}

pub(crate) fn argmax(row: &[f32]) -> u32 {
    row.iter().enumerate().fold(0, |best, (i, &x)| if x > row[best] { i } else { best }) as u32
}

/// The CUDA generator against the CPU generator on every golden model (weights rounded to bf16
/// so both run the same model): the logits of a 9-token prompt and of 6 decode steps fed the
/// CPU's greedy tokens; then the same GPU logits against the GPU's own training forward over
/// the whole sequence.
#[test]
pub(crate) fn decode_generation_matches_the_cpu_and_the_training_forward() {
    for case in ["llama", "llama-linear", "qwen2", "qwen3", "mistral", "phi3", "gemma3", "gemma2"] {
        let (spec, mut p) = HostParams::load_dir(&golden_dir(case)).expect("golden model");
        for u in &mut p.units {
            u.iter_mut().for_each(|x| *x = bf16::from_f32(*x).to_f32());
        }
        let vocab = spec.vocab;
        let on_cpu = Generator::new(spec.clone(), p.clone(), None).expect("cpu generator");
        let cuda = Cuda::new(0).expect("a second handle on the GPU");
        let on_gpu = Generator::on(cuda, spec.clone(), p.clone(), None).expect("gpu generator");
        let mut seq: Vec<u32> = (0..9).map(|i| (i * 37 + 5) % vocab as u32).collect();
        let steps = 6;
        let mut cc = on_cpu.cache_for(seq.len() + steps).expect("cpu cache");
        let mut gc = on_gpu.cache_for(seq.len() + steps).expect("gpu cache");
        let mut want = on_cpu.logits(&mut cc, &seq).expect("cpu prompt");
        let mut got = on_gpu.logits(&mut gc, &seq).expect("gpu prompt");
        // The GPU keeps the residual stream and every intermediate in bf16 (2^-9 relative each)
        // through two layers and the head: ~1e-2 of the logits' scale. A wrong op or a cache
        // row in the wrong place is off by O(1).
        check(&format!("generate {case}: prompt logits"), &got, &want, 3e-2);
        let mut all_gpu = got.clone();
        for step in 0..steps {
            let next = argmax(&want[want.len() - vocab..]);
            seq.push(next);
            want = on_cpu.logits(&mut cc, &[next]).expect("cpu step");
            got = on_gpu.logits(&mut gc, &[next]).expect("gpu step");
            check(&format!("generate {case}: decode step {step} logits"), &got, &want, 3e-2);
            all_gpu.extend_from_slice(&got);
        }
        let n = seq.len() as i32;
        let mb = MicroBatch {
            rows: 1,
            seq_len: seq.len(),
            ids: seq.iter().map(|&i| i as i32).collect(),
            targets: vec![IGNORE; seq.len()],
            positions: (0..n).collect(),
            cu_seqlens: vec![0, n],
        };
        let mut trainer = Trainer::new(gpu(), &spec, p, config(), seq.len()).expect("gpu trainer");
        let uncached = trainer.logits(&mb).expect("training forward");
        // The same bf16 ops on the same GPU but for the attention kernels, which differ by f32
        // ulps that rarely tip a bf16 rounding (measured: 1.1e-7 of the scale at most).
        check(
            &format!("generate {case}: GPU cached vs training forward"),
            &all_gpu,
            &uncached,
            1e-3,
        );
    }
}

/// Not a parity check: greedy decoding speed on the CPU and the GPU, for a golden model
/// (launch-bound) and a 155M-parameter llama-shaped model with random weights, printed.
#[test]
pub(crate) fn decode_speed_cpu_and_gpu() {
    let mid = spec_from(serde_json::json!({
        "model_type": "llama", "vocab_size": 32000, "hidden_size": 1024,
        "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
        "num_key_value_heads": 4, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": false, "max_position_embeddings": 4096,
    }));
    let models = [
        ("golden llama", HostParams::load_dir(&golden_dir("llama")).expect("golden")),
        ("155M llama-shaped", (mid.clone(), HostParams::random(&mid, 3))),
    ];
    for (name, (spec, p)) in models {
        let prompt: Vec<u32> = (0..16).map(|i| (i * 31 + 7) % spec.vocab as u32).collect();
        let new = 40; // the golden models hold 64 positions
        // Without stop tokens every run makes exactly `new` tokens.
        let mut spec = spec;
        spec.eos_token_ids.clear();
        let time = |g: &dyn Fn(&mut dyn FnMut(u32) -> bool) -> usize| {
            g(&mut |_| true); // warm-up: GEMM plans, kernel loads, pools
            let start = std::time::Instant::now();
            let mut first = None;
            let made = g(&mut |_| {
                first.get_or_insert_with(std::time::Instant::now);
                true
            });
            let first = first.expect("a first token");
            assert_eq!(made, new, "{name}: stopped early");
            ((first - start).as_secs_f64(), (made - 1) as f64 / first.elapsed().as_secs_f64())
        };
        let cpu = Generator::new(spec.clone(), p.clone(), None).expect("cpu");
        let (cpu_prompt, cpu_rate) = time(&|f| {
            cpu.generate(&prompt, &GenerateOptions::greedy(new), f).expect("cpu").ids.len()
        });
        let gpu_gen =
            Generator::on(Cuda::new(0).expect("gpu"), spec.clone(), p, None).expect("gpu");
        let (gpu_prompt, gpu_rate) = time(&|f| {
            gpu_gen.generate(&prompt, &GenerateOptions::greedy(new), f).expect("gpu").ids.len()
        });
        println!(
            "greedy decode, {name}, 16-token prompt, {new} tokens: cpu {cpu_rate:.0} tokens/s \
             (prompt {:.1} ms), gpu {gpu_rate:.0} tokens/s (prompt {:.1} ms)",
            cpu_prompt * 1e3,
            gpu_prompt * 1e3
        );
    }
}

/// Batched inference on the GPU (`Keys::Batch`: several sequences' caches side by side in one
/// buffer per layer): batched scores against the GPU's own one-sequence forward, batched greedy
/// answers against one-sequence generation, and streamed weights against resident ones, on
/// every golden model.
#[test]
pub(crate) fn batched_inference_matches_one_sequence_on_the_gpu() {
    use sluice_engine::generate::batch::{Model as BatchModel, generate_batch, score_batch};
    use sluice_engine::generate::{BatchLimits, Streamed};
    use sluice_engine::model::Decoder;
    let limits = BatchLimits { sequences: 3, tokens: 24 };
    for case in ["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma3", "gemma2"] {
        let (spec, mut p) = HostParams::load_dir(&golden_dir(case)).expect("golden model");
        for u in &mut p.units {
            u.iter_mut().for_each(|x| *x = bf16::from_f32(*x).to_f32());
        }
        let vocab = spec.vocab as u32;
        let g = Generator::on(Cuda::new(0).expect("gpu"), spec.clone(), p.clone(), None)
            .expect("gpu generator");
        let seqs: Vec<Vec<u32>> = (0..5)
            .map(|s| (0..(4 + 3 * s)).map(|i| (i * 37 + s * 11 + 5) % vocab).collect())
            .collect();
        // Scores: each sequence's last half as the continuation of its first half.
        let pairs: Vec<(Vec<u32>, Vec<u32>)> =
            seqs.iter().map(|s| (s[..s.len() / 2].to_vec(), s[s.len() / 2..].to_vec())).collect();
        let scored = g.score(&pairs, limits).expect("batched scores");
        for (i, (context, continuation)) in pairs.iter().enumerate() {
            let whole: Vec<u32> = context.iter().chain(continuation).copied().collect();
            let logits = g.logits(&mut g.cache(), &whole).expect("one sequence");
            let v = spec.vocab;
            let mut want = 0.0f64;
            for r in context.len() - 1..whole.len() - 1 {
                let row = &logits[r * v..(r + 1) * v];
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let lse = row.iter().map(|&z| f64::from(z - max).exp()).sum::<f64>().ln();
                want += f64::from(row[whole[r + 1] as usize] - max) - lse;
            }
            // The same kernels; only the GEMMs' row counts differ (bf16 outputs either way).
            let err = (scored[i].logprob - want).abs() / want.abs().max(1.0);
            check(
                &format!("batched score {case} #{i}"),
                &[scored[i].logprob as f32],
                &[want as f32],
                2e-2,
            );
            assert!(err < 2e-2, "{case} #{i}: {} vs {want}", scored[i].logprob);
        }
        let greedy = GenerateOptions::greedy(5);
        let batched = g.generate_batch(&seqs, &greedy, limits).expect("batched generation");
        let mut agree = 0;
        for (i, s) in seqs.iter().enumerate() {
            let alone = g.generate(s, &greedy, &mut |_| true).expect("one sequence");
            agree += usize::from(alone == batched[i]);
        }
        // bf16 GEMMs over other row counts can tip a near tie; most answers agree exactly.
        assert!(agree >= 4, "{case}: {agree} of 5 batched answers equal one-sequence ones");
        let cuda = Cuda::new(0).expect("gpu");
        let decoder = Decoder::new(&cuda, &spec, p.layout.layers.clone(), p.layout.head.clone())
            .expect("decoder");
        let model = BatchModel { b: &cuda, spec: &spec, decoder: &decoder };
        let mut units = Streamed::new(&cuda, &p.layout, &p).expect("streamed weights");
        let streamed = generate_batch(&model, &mut units, &seqs, &greedy, &g.stop_ids(), limits)
            .expect("streamed generation");
        assert_eq!(streamed, batched, "{case}: streamed and resident weights differ");
        let streamed_scores = score_batch(&model, &mut units, &pairs, limits).expect("scores");
        assert_eq!(streamed_scores, scored, "{case}: streamed scores differ");
    }
}
