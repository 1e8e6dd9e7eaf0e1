//! Generation against the training forward: cached logits equal uncached ones for every family,
//! greedy and sampled decoding, stops, bad input and the cache's bounds.

#![allow(clippy::unwrap_used)]

use serde_json::json;

use super::*;
use crate::backend::cpu::Cpu;
use crate::data::MicroBatch;
use crate::train::{TrainConfig, Trainer};

/// A small model of `family` with the given extra config fields.
fn spec(model_type: &str, extra: serde_json::Value) -> ModelSpec {
    let mut raw = json!({
        "model_type": model_type, "vocab_size": 61, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": model_type != "mistral", "eos_token_id": 60,
    });
    for (k, v) in extra.as_object().unwrap() {
        raw[k] = v.clone();
    }
    ModelSpec::from_hf(raw, Path::new("<test>")).unwrap()
}

fn specs() -> Vec<ModelSpec> {
    vec![
        spec("llama", json!({})),
        spec("qwen2", json!({})),
        spec("qwen3", json!({"head_dim": 16})),
        spec("mistral", json!({"sliding_window": 5})),
        // Partial rotary and longrope past the original 2 positions from the first call on, so
        // every split of the sequence uses the long factors, as one pass does.
        spec(
            "phi3",
            json!({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5, "original_max_position_embeddings": 2,
            "short_factor": [1.0, 1.5], "long_factor": [1.0, 4.0]}}),
        ),
        // Gemma 2: soft-capped scores and logits (caps low enough to bend them), a sliding
        // layer then a global one.
        spec(
            "gemma2",
            json!({"sliding_window": 5, "query_pre_attn_scalar": 16,
            "attn_logit_softcapping": 1.0, "final_logit_softcapping": 0.5}),
        ),
        // Gemma 3: a sliding layer with its local RoPE, then a global one.
        spec(
            "gemma3_text",
            json!({"sliding_window": 5, "query_pre_attn_scalar": 16,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
            }}),
        ),
    ]
}

/// Random weights with non-trivial norms and biases, so every parameter matters.
fn params(spec: &ModelSpec, seed: u64) -> HostParams {
    let mut p = HostParams::random(spec, seed);
    for unit in &mut p.units {
        for (i, x) in unit.iter_mut().enumerate() {
            if *x == 0.0 || *x == 1.0 {
                *x += ((i * 7919 + seed as usize) % 13) as f32 * 0.01;
            }
        }
    }
    p
}

fn trainer_logits(spec: &ModelSpec, p: &HostParams, ids: &[u32]) -> Vec<f32> {
    let cpu = Cpu::new();
    let mut trainer =
        Trainer::new(&cpu, spec, p.clone(), TrainConfig::default(), ids.len()).unwrap();
    let n = ids.len() as i32;
    let mb = MicroBatch {
        rows: 1,
        seq_len: ids.len(),
        ids: ids.iter().map(|&i| i as i32).collect(),
        targets: vec![-100; ids.len()],
        positions: (0..n).collect(),
        cu_seqlens: vec![0, n],
    };
    trainer.logits(&mb).unwrap()
}

fn assert_close(what: &str, got: &[f32], want: &[f32], rel: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= rel * scale,
            "{what}: index {i}: got {g}, want {w} (scale {scale})"
        );
    }
}

#[test]
fn cached_logits_match_the_training_forward_for_every_family() {
    let ids: Vec<u32> = vec![3, 17, 42, 5, 5, 59, 0, 23, 11, 8, 30];
    for spec in specs() {
        let p = params(&spec, 7);
        let want = trainer_logits(&spec, &p, &ids);
        let g = Generator::new(spec.clone(), p, None).unwrap();
        // All at once, then split as a prompt followed by single tokens: both must agree with
        // the uncached forward at every position.
        let mut cache = g.cache();
        let all = g.logits(&mut cache, &ids).unwrap();
        assert_close(&format!("{:?} one pass", spec.family), &all, &want, 1e-5);
        let mut cache = g.cache();
        let mut pieces = g.logits(&mut cache, &ids[..4]).unwrap();
        for &id in &ids[4..] {
            pieces.extend(g.logits(&mut cache, &[id]).unwrap());
        }
        assert_eq!(cache.len(), ids.len());
        assert_close(&format!("{:?} incremental", spec.family), &pieces, &want, 1e-5);
        let mut cache = g.cache();
        let last = g.next_logits(&mut cache, &ids).unwrap();
        assert_close("last row", &last, &want[want.len() - spec.vocab..], 1e-5);
    }
}

#[test]
fn greedy_generation_follows_the_argmax_of_the_uncached_forward() {
    let spec = spec("llama", json!({}));
    let p = params(&spec, 3);
    let g = Generator::new(spec.clone(), p.clone(), None).unwrap();
    let prompt = vec![1u32, 2, 3];
    let out = g.generate(&prompt, &GenerateOptions::greedy(6), &mut |_| true).unwrap();
    // Recompute every step from scratch with the training forward.
    let mut seq = prompt.clone();
    for &id in &out.ids {
        let logits = trainer_logits(&spec, &p, &seq);
        let want = sample::argmax(&logits[logits.len() - spec.vocab..]);
        assert_eq!(id, want, "after {seq:?}");
        seq.push(id);
    }
    if !out.stopped_at_eos {
        assert_eq!(out.ids.len(), 6);
    }
}

#[test]
fn sampling_is_reproducible_for_a_seed_and_respects_top_p() {
    let spec = spec("llama", json!({}));
    let g = Generator::new(spec.clone(), params(&spec, 5), None).unwrap();
    let opts = GenerateOptions { max_new_tokens: 8, temperature: 1.5, top_p: 0.9, seed: 11 };
    let a = g.generate(&[4, 9], &opts, &mut |_| true).unwrap();
    let b = g.generate(&[4, 9], &opts, &mut |_| true).unwrap();
    assert_eq!(a, b);

    // A tiny nucleus keeps only the most likely token: sampling becomes greedy.
    let mut s = Sampler::new(&GenerateOptions { top_p: 1e-6, ..opts.clone() }).unwrap();
    let logits = [0.1f32, 3.0, 2.9, -1.0];
    for _ in 0..20 {
        assert_eq!(s.pick(&logits).unwrap(), 1);
    }
    // A wide one draws the second token too.
    let mut s = Sampler::new(&GenerateOptions { top_p: 1.0, temperature: 1.0, ..opts }).unwrap();
    let picks: Vec<u32> = (0..200).map(|_| s.pick(&logits).unwrap()).collect();
    assert!(picks.contains(&1) && picks.contains(&2), "{picks:?}");
}

#[test]
fn stops_at_eos_and_when_the_callback_says_so() {
    let spec = spec("llama", json!({}));
    let p = params(&spec, 3);
    let g = Generator::new(spec.clone(), p.clone(), None).unwrap();
    let free = g.generate(&[1, 2], &GenerateOptions::greedy(3), &mut |_| true).unwrap();
    let first = free.ids[0];
    // Make the first greedy token the eos: generation stops before emitting anything.
    let mut spec_eos = spec.clone();
    spec_eos.eos_token_ids = vec![first];
    let g2 = Generator::new(spec_eos, p, None).unwrap();
    let stopped = g2.generate(&[1, 2], &GenerateOptions::greedy(3), &mut |_| true).unwrap();
    assert_eq!(stopped, Generated { ids: vec![], stopped_at_eos: true });
    let mut seen = 0;
    let cut = g
        .generate(&[1, 2], &GenerateOptions::greedy(5), &mut |_| {
            seen += 1;
            seen < 2
        })
        .unwrap();
    assert_eq!(cut.ids.len(), 2);
}

#[test]
fn bad_input_is_an_error() {
    let spec = spec("llama", json!({}));
    let g = Generator::new(spec.clone(), params(&spec, 1), None).unwrap();
    let mut cache = g.cache();
    assert!(g.logits(&mut cache, &[]).is_err());
    let err = g.logits(&mut cache, &[61]).unwrap_err().to_string();
    assert!(err.contains("61"), "{err}");
    let long = vec![1u32; 65];
    let err = g.logits(&mut g.cache(), &long).unwrap_err().to_string();
    assert!(err.contains("context of 64"), "{err}");
    let err = Sampler::new(&GenerateOptions { temperature: -1.0, ..GenerateOptions::greedy(1) });
    assert!(err.is_err());
    assert!(g.prompt_ids("hi", PromptStyle::Plain).is_err());
    let other = self::spec("qwen2", json!({}));
    assert!(Generator::new(other, params(&spec, 1), None).is_err());
}

#[test]
fn a_cache_sized_for_the_run_never_grows_and_clearing_restarts_the_sequence() {
    let spec = spec("mistral", json!({"sliding_window": 5}));
    let g = Generator::new(spec.clone(), params(&spec, 4), None).unwrap();
    let ids = [7u32, 1, 30, 2, 2, 44, 9, 13];
    let mut grown = g.cache();
    let want = g.logits(&mut grown, &ids).unwrap();
    assert_eq!(grown.capacity(), ids.len());

    let mut sized = g.cache_for(ids.len()).unwrap();
    assert_eq!((sized.len(), sized.capacity()), (0, ids.len()));
    let mut got = g.logits(&mut sized, &ids[..3]).unwrap();
    for &id in &ids[3..] {
        got.extend(g.logits(&mut sized, &[id]).unwrap());
    }
    assert_eq!(sized.capacity(), ids.len(), "the cache grew");
    assert_eq!(got, want, "a prompt then single tokens must give the whole sequence's logits");

    sized.clear();
    assert!(sized.is_empty());
    assert_eq!(g.logits(&mut sized, &ids).unwrap(), want);
    // Past the model's context a cache is capped there, and the forward refuses to overflow it.
    assert_eq!(g.cache_for(1000).unwrap().capacity(), spec.max_positions);
}

/// Prompts of different lengths, so a batch's rows and cache bases differ per sequence.
fn prompts() -> Vec<Vec<u32>> {
    vec![vec![3, 17, 42], vec![5], vec![9, 8, 7, 6, 5, 4, 3], vec![59, 1], vec![30, 31, 32, 33]]
}

#[test]
fn batched_generation_equals_one_sequence_at_a_time_for_every_family() {
    // Small limits force several prefill forwards and several groups.
    let limits = BatchLimits { sequences: 3, tokens: 8 };
    for spec in specs() {
        let p = params(&spec, 11);
        let g = Generator::new(spec.clone(), p.clone(), None).unwrap();
        for options in [
            GenerateOptions::greedy(7),
            GenerateOptions { max_new_tokens: 5, temperature: 0.8, top_p: 0.9, seed: 4 },
        ] {
            let batched = g.generate_batch(&prompts(), &options, limits).unwrap();
            for (i, prompt) in prompts().iter().enumerate() {
                let own = GenerateOptions { seed: options.seed + i as u64, ..options.clone() };
                let alone = g.generate(prompt, &own, &mut |_| true).unwrap();
                assert_eq!(batched[i], alone, "{:?} prompt {i} {options:?}", spec.family);
            }
        }
    }
}

#[test]
fn streamed_weights_give_the_resident_answers() {
    let spec = spec("qwen2", json!({}));
    let p = params(&spec, 5);
    let g = Generator::new(spec.clone(), p.clone(), None).unwrap();
    let limits = BatchLimits { sequences: 4, tokens: 64 };
    let options = GenerateOptions::greedy(6);
    let resident = g.generate_batch(&prompts(), &options, limits).unwrap();
    let cpu = Cpu::new();
    let decoder =
        crate::model::Decoder::new(&cpu, &spec, p.layout.layers.clone(), p.layout.head.clone())
            .unwrap();
    let model = batch::Model { b: &cpu, spec: &spec, decoder: &decoder };
    let mut units = Streamed::new(&cpu, &p.layout, &p).unwrap();
    let streamed =
        batch::generate_batch(&model, &mut units, &prompts(), &options, &g.stop_ids(), limits)
            .unwrap();
    assert_eq!(streamed, resident);
    let pairs = vec![(vec![1u32, 2], vec![3u32, 4]), (vec![7], vec![8, 9, 10])];
    let a = batch::score_batch(&model, &mut units, &pairs, limits).unwrap();
    assert_eq!(a, g.score(&pairs, limits).unwrap());
}

#[test]
fn scores_are_the_log_softmax_of_the_full_forward() {
    for spec in specs() {
        let p = params(&spec, 2);
        let g = Generator::new(spec.clone(), p.clone(), None).unwrap();
        let pairs: Vec<(Vec<u32>, Vec<u32>)> = vec![
            (vec![3, 17, 42], vec![5, 6]),
            (vec![1], vec![2]),
            (vec![9, 8, 7, 6], vec![5, 4, 3, 2, 1]),
        ];
        let scored = g.score(&pairs, BatchLimits { sequences: 2, tokens: 9 }).unwrap();
        for (i, (context, continuation)) in pairs.iter().enumerate() {
            let whole: Vec<u32> = context.iter().chain(continuation).copied().collect();
            let logits = trainer_logits(&spec, &p, &whole);
            let v = spec.vocab;
            let (mut want, mut greedy) = (0.0f64, true);
            for r in context.len() - 1..whole.len() - 1 {
                let row = &logits[r * v..(r + 1) * v];
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let lse = row.iter().map(|&z| f64::from(z - max).exp()).sum::<f64>().ln();
                want += f64::from(row[whole[r + 1] as usize] - max) - lse;
                greedy &= sample::argmax(row) == whole[r + 1];
            }
            let got = scored[i];
            assert_eq!(got.tokens, continuation.len());
            assert!(
                (got.logprob - want).abs() < 1e-4,
                "{:?} {i}: {} vs {want}",
                spec.family,
                got.logprob
            );
            assert_eq!(got.greedy, greedy);
        }
    }
}

#[test]
fn batched_bad_input_is_an_error() {
    let spec = spec("llama", json!({}));
    let g = Generator::new(spec.clone(), params(&spec, 1), None).unwrap();
    let limits = BatchLimits { sequences: 2, tokens: 8 };
    let greedy = GenerateOptions::greedy(2);
    assert!(g.generate_batch(&[vec![]], &greedy, limits).is_err());
    assert!(g.generate_batch(&[vec![1; 64]], &greedy, limits).is_err());
    assert!(
        g.generate_batch(&[vec![1]], &greedy, BatchLimits { sequences: 0, tokens: 8 }).is_err()
    );
    assert!(g.score(&[(vec![], vec![1])], limits).is_err());
    assert!(g.score(&[(vec![1], vec![])], limits).is_err());
    assert!(g.score(&[(vec![1; 40], vec![1; 30])], limits).is_err());
    assert!(g.score(&[(vec![1], vec![99])], limits).is_err());
}
