//! The optimizer against fixtures made by torch 2.11.0 and transformers 5.17.0
//! (scripts/golden/make_fixtures.py, format in tests/golden/README.md).

use std::collections::HashMap;
use std::path::PathBuf;

use safetensors::{Dtype, SafeTensors};

use super::{AdamW, LrSchedule, Schedule, TensorStep, adamw_step, clip_coef, sum_of_squares};

struct Fixture {
    path: PathBuf,
    bytes: Vec<u8>,
}

impl Fixture {
    fn open(case: &str) -> Fixture {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/golden")
            .join(case)
            .join("fixture.safetensors");
        let bytes = std::fs::read(&path).unwrap_or_else(|e| {
            panic!("{}: {e} (regenerate with scripts/golden/make_fixtures.py)", path.display())
        });
        Fixture { path, bytes }
    }

    fn tensors(&self) -> SafeTensors<'_> {
        SafeTensors::deserialize(&self.bytes)
            .unwrap_or_else(|e| panic!("{}: {e}", self.path.display()))
    }

    fn f32(&self, name: &str) -> Vec<f32> {
        let view = self
            .tensors()
            .tensor(name)
            .unwrap_or_else(|e| panic!("{}: {name}: {e}", self.path.display()));
        assert_eq!(view.dtype(), Dtype::F32, "{}: {name}", self.path.display());
        view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
    }

    fn names(&self) -> Vec<String> {
        self.tensors().names().into_iter().map(str::to_owned).collect()
    }

    fn metadata(&self) -> HashMap<String, String> {
        let (_, meta) = SafeTensors::read_metadata(&self.bytes)
            .unwrap_or_else(|e| panic!("{}: {e}", self.path.display()));
        meta.metadata().clone().unwrap_or_default()
    }

    fn meta_f32(&self, key: &str) -> f32 {
        let meta = self.metadata();
        let text =
            meta.get(key).unwrap_or_else(|| panic!("{}: no metadata {key}", self.path.display()));
        text.parse().unwrap_or_else(|e| panic!("{}: {key} = {text}: {e}", self.path.display()))
    }
}

fn ulps(a: f32, b: f32) -> u32 {
    (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
}

#[test]
fn adamw_matches_torch_on_loose_tensors() {
    let fx = Fixture::open("adamw");
    let hp = AdamW {
        lr: 0.0,
        beta1: fx.meta_f32("adamw.beta1"),
        beta2: fx.meta_f32("adamw.beta2"),
        eps: fx.meta_f32("adamw.eps"),
        weight_decay: fx.meta_f32("adamw.weight_decay"),
    };
    let lrs: Vec<f32> =
        serde_json::from_str(&fx.metadata()["lr"]).expect("lr metadata is a JSON list");
    let (mut worst, mut differing, mut total) = (0, 0, 0);
    for (key, decay) in [("a", false), ("b", true), ("c", true)] {
        let mut p = fx.f32(&format!("{key}.p.0"));
        let (mut m, mut v) = (vec![0.0; p.len()], vec![0.0; p.len()]);
        for (i, &lr) in lrs.iter().enumerate() {
            let step = i + 1;
            let g = fx.f32(&format!("{key}.grad.{step}"));
            let args = TensorStep { step: step as u64, lr, hp, decay };
            adamw_step(&mut p, &g, &mut m, &mut v, &args).expect("valid");
            // The moments do not involve sqrt: bit for bit.
            assert_eq!(m, fx.f32(&format!("{key}.m.{step}")), "{key} m after step {step}");
            assert_eq!(v, fx.f32(&format!("{key}.v.{step}")), "{key} v after step {step}");
            // Parameters: torch's MKL sqrt is off by an ulp now and then, which moves the update
            // (at most a few lr in size) by about an f32 epsilon relative, and the final sum by
            // at most an ulp of the parameter.
            let want = fx.f32(&format!("{key}.p.{step}"));
            for (j, (&a, &b)) in p.iter().zip(&want).enumerate() {
                let tol = f32::EPSILON * (b.abs() + 4.0 * lr);
                assert!((a - b).abs() <= tol, "{key}[{j}] after step {step}: {a} vs torch {b}");
                worst = worst.max(ulps(a, b));
                differing += usize::from(a != b);
                total += 1;
            }
            // Resynchronise so each step is checked from torch's own state.
            p = want;
        }
    }
    eprintln!("adamw vs torch: {differing} of {total} parameters differ, by at most {worst} ulp");
    assert!(differing * 10 < total, "sqrt rounding explains a few differences, not {differing}");
}

/// The first step of every model fixture: our global norm of HF's gradients equals torch's
/// `clip_grad_norm_` result, and the cosine schedule gives the rates the trajectory used.
#[test]
fn clip_and_schedule_match_the_model_trajectories() {
    for case in ["llama", "llama-linear", "qwen2", "qwen3", "mistral"] {
        let fx = Fixture::open(case);
        let sum: f64 = fx
            .names()
            .iter()
            .filter(|n| n.starts_with("grad."))
            .map(|n| sum_of_squares(&fx.f32(n)))
            .sum();
        let norm = sum.sqrt() as f32;
        let torch_norm = fx.f32("traj.grad_norm")[0];
        assert!(ulps(norm, torch_norm) <= 2, "{case}: norm {norm} vs torch {torch_norm}");
        let max_norm = fx.meta_f32("clip.max_norm");
        let coef = clip_coef(sum.sqrt(), max_norm).expect("finite");
        assert!(coef < 1.0, "{case}: the fixture is meant to clip on step 1");

        let meta = fx.metadata();
        let count = |key: &str| -> u64 { meta[key].parse().expect("integer metadata") };
        assert_eq!(meta["schedule"], "cosine");
        let sched = LrSchedule {
            kind: Schedule::Cosine,
            peak_lr: fx.meta_f32("adamw.lr"),
            warmup_steps: count("schedule.warmup_steps"),
            total_steps: count("schedule.total_steps"),
        };
        let lrs: Vec<f32> = (0..count("steps")).map(|s| sched.lr_at(s)).collect();
        assert_eq!(lrs, fx.f32("traj.lr"), "{case}: learning rates");
    }
}
