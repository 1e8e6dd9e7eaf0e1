//! The golden fixtures (`tests/golden/<case>/`, made by `scripts/golden/make_fixtures.py` in
//! float32 with eager attention: a model, a batch, transformers' logits, loss, every parameter
//! gradient, and a 5-step AdamW trajectory with clipping and a cosine schedule) and the one check
//! of a model against them, shared by the golden tests and the tests that read a golden model
//! another way (a multimodal folder built from it). Tolerances are stated where they are used,
//! with the reason.

use std::path::{Path, PathBuf};

use safetensors::SafeTensors;
use sluice_engine::backend::IGNORE;
use sluice_engine::backend::cpu::Cpu;
use sluice_engine::data::MicroBatch;
use sluice_engine::model::HostParams;
use sluice_engine::optim::Schedule;
use sluice_engine::spec::ModelSpec;
use sluice_engine::train::{TrainConfig, Trainer};

/// The folder of a golden case: its `config.json`, `model.safetensors` and `fixture.safetensors`.
pub fn case_dir(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/golden").join(case)
}

pub struct Fixture {
    bytes: Vec<u8>,
}

impl Fixture {
    pub fn open(case: &str) -> Fixture {
        let path = case_dir(case).join("fixture.safetensors");
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        Fixture { bytes }
    }

    fn tensors(&self) -> SafeTensors<'_> {
        SafeTensors::deserialize(&self.bytes).expect("fixture parses")
    }

    fn f32s(&self, name: &str) -> Vec<f32> {
        let st = self.tensors();
        let t = st.tensor(name).unwrap_or_else(|_| panic!("fixture has no {name}"));
        assert_eq!(t.dtype(), safetensors::Dtype::F32, "{name}");
        t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }

    fn i32s(&self, name: &str) -> (Vec<usize>, Vec<i32>) {
        let st = self.tensors();
        let t = st.tensor(name).unwrap_or_else(|_| panic!("fixture has no {name}"));
        assert_eq!(t.dtype(), safetensors::Dtype::I32, "{name}");
        let data = t
            .data()
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        (t.shape().to_vec(), data)
    }

    fn has(&self, name: &str) -> bool {
        self.tensors().tensor(name).is_ok()
    }

    /// A metadata entry (`moe.num_experts`, ...).
    fn meta(&self, key: &str) -> String {
        let (_, st) = SafeTensors::read_metadata(&self.bytes).expect("fixture metadata");
        let meta = st.metadata().clone().unwrap_or_default();
        meta.get(key).unwrap_or_else(|| panic!("fixture metadata has no {key}")).clone()
    }

    /// The batch as one micro-batch of packed rows. transformers shifts labels inside the loss
    /// (`logits[t]` predicts `labels[t + 1]`); the engine's targets are already shifted.
    pub fn batch(&self) -> MicroBatch {
        self.batch_of("input_ids", Some("labels"))
    }

    /// `ids` (and, if given, `labels`, else nothing trained) as one micro-batch of packed rows.
    fn batch_of(&self, ids: &str, labels: Option<&str>) -> MicroBatch {
        let (shape, ids) = self.i32s(ids);
        let labels = match labels {
            Some(name) => self.i32s(name).1,
            None => vec![IGNORE; ids.len()],
        };
        let (rows, seq) = (shape[0], shape[1]);
        let mut targets = vec![IGNORE; rows * seq];
        for r in 0..rows {
            for t in 0..seq - 1 {
                targets[r * seq + t] = labels[r * seq + t + 1];
            }
        }
        MicroBatch {
            rows,
            seq_len: seq,
            ids,
            targets,
            positions: (0..rows).flat_map(|_| 0..seq as i32).collect(),
            cu_seqlens: (0..=rows).map(|r| (r * seq) as i32).collect(),
        }
    }
}

/// Largest |a - b| relative to the largest |b|, with the worst index.
/// The fixture's values for one of Sluice's tensors, `<kind>.<name>`. transformers 5 holds a
/// Mixtral or Qwen MoE layer's experts fused (`mlp.experts.gate_up_proj` `[E, 2I, H]`, each
/// expert's gate rows then its up rows; `mlp.experts.down_proj` `[E, H, I]`; the router as
/// `mlp.gate`) and names its gradients so, while checkpoints keep one tensor per expert (`w1`,
/// `w3`, `w2` or `gate_proj`, `up_proj`, `down_proj`): a per-expert tensor is its slice of the
/// fused one.
fn expected(fx: &Fixture, kind: &str, name: &str) -> Vec<f32> {
    let direct = format!("{kind}.{name}");
    if fx.has(&direct) {
        return fx.f32s(&direct);
    }
    let parts: Vec<&str> = name.split('.').collect();
    let layer = parts.get(2).expect("a layer tensor");
    let fused = |t: &str| format!("{kind}.model.layers.{layer}.mlp.{t}");
    if name.ends_with("block_sparse_moe.gate.weight") {
        return fx.f32s(&fused("gate.weight"));
    }
    let at = parts.iter().position(|p| *p == "experts").expect("an expert tensor");
    let expert: usize = parts[at + 1].parse().expect("expert index");
    let (tensor, half) = match parts[at + 2] {
        "w1" | "gate_proj" => ("experts.gate_up_proj", Some(0)),
        "w3" | "up_proj" => ("experts.gate_up_proj", Some(1)),
        "w2" | "down_proj" => ("experts.down_proj", None),
        other => panic!("no fused tensor holds {other}"),
    };
    let all = fx.f32s(&fused(tensor));
    let experts: usize = fx.meta("moe.num_experts").parse().expect("moe.num_experts");
    let per = all.len() / experts;
    let mine = &all[expert * per..(expert + 1) * per];
    match half {
        Some(h) => mine[h * per / 2..(h + 1) * per / 2].to_vec(),
        None => mine.to_vec(),
    }
}

fn max_rel_err(actual: &[f32], expected: &[f32]) -> (f32, usize) {
    assert_eq!(actual.len(), expected.len());
    let scale = expected.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-12);
    let (mut worst, mut at) = (0f32, 0);
    for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
        let d = (a - e).abs() / scale;
        if d > worst || d.is_nan() {
            (worst, at) = (d, i);
        }
    }
    (worst, at)
}

/// Checks `actual` against `expected` and returns the error, so each case can report its worst.
fn assert_close(what: &str, actual: &[f32], expected: &[f32], tol: f32) -> f32 {
    let (err, at) = max_rel_err(actual, expected);
    assert!(
        err <= tol,
        "{what}: max relative error {err:.3e} > {tol:.0e} at index {at}: got {} expected {} (first pairs: {:?})",
        actual[at],
        expected[at],
        actual.iter().zip(expected).take(4).collect::<Vec<_>>()
    );
    err
}

fn trainer_config(fx: &Fixture) -> TrainConfig {
    let st = SafeTensors::read_metadata(&fx.bytes).expect("fixture metadata").1;
    let meta = st.metadata().clone().unwrap_or_default();
    let num = |k: &str| -> f32 {
        meta.get(k).unwrap_or_else(|| panic!("fixture metadata has no {k}")).parse().expect(k)
    };
    TrainConfig {
        lr: num("adamw.lr"),
        schedule: meta["schedule"].parse::<Schedule>().expect("schedule"),
        warmup_steps: num("schedule.warmup_steps") as u64,
        total_steps: num("schedule.total_steps") as u64,
        weight_decay: num("adamw.weight_decay"),
        beta1: num("adamw.beta1"),
        beta2: num("adamw.beta2"),
        eps: num("adamw.eps"),
        max_grad_norm: Some(num("clip.max_norm")),
    }
}

/// Checks a model against golden case `case`'s fixture (the model is the case's own, or the same
/// weights read another way; `label` names it in failures): its logits, its loss and every
/// gradient, then five optimizer steps and the weights they leave.
pub fn check_against(case: &str, label: &str, spec: &ModelSpec, params: HostParams) {
    let fx = Fixture::open(case);
    let mb = fx.batch();
    let cpu = Cpu;
    let mut trainer = Trainer::new(&cpu, spec, params.clone(), trainer_config(&fx), mb.ids.len())
        .expect("trainer");

    // Logits: forward only, f32 on both sides; differences come from summation order alone
    // (matmul blocking, softmax reductions), a few ulps amplified through 2 layers: 1e-5 of the
    // largest logit.
    let logits = trainer.logits(&mb).expect("logits");
    let logits_err = assert_close(&format!("{label} logits"), &logits, &fx.f32s("logits"), 1e-5);

    // Phi-3's longrope uses its short factors when a forward's positions stay within the
    // pretrained context: the fixture's short batch (8 positions of 8) checks that table, the
    // full one (13) the long table. Same tolerance as the logits above.
    if fx.has("short.logits") {
        let short = trainer.logits(&fx.batch_of("short.input_ids", None)).expect("short logits");
        assert_close(&format!("{label} short logits"), &short, &fx.f32s("short.logits"), 1e-5);
    }

    // Loss and gradients of every parameter. Gradients pass through more reductions (attention
    // backward, weight-gradient sums over tokens), so 1e-4 of each tensor's largest entry.
    let (loss, grads) = trainer.loss_and_grads(std::slice::from_ref(&mb)).expect("grads");
    let expected_loss = fx.f32s("loss")[0] as f64;
    assert!(
        (loss - expected_loss).abs() <= 1e-5 * expected_loss.abs(),
        "{label} loss {loss} vs {expected_loss}"
    );
    let grads = grads.to_vec();
    // A mixture of experts: the load-balancing loss itself (its coefficient times it is in
    // `loss` above), from the same routing, summed in another order: same tolerance.
    let aux_err = if fx.has("aux_loss") {
        let want = fx.f32s("aux_loss")[0] as f64;
        let got = trainer.aux_loss().expect("a MoE model reports its load-balancing loss");
        let err = (got - want).abs() / want.abs();
        assert!(err <= 1e-5, "{label} aux loss {got} vs {want}");
        format!(", aux loss {err:.1e}")
    } else {
        String::new()
    };
    let mut grad_err = 0f32;
    for (u, t) in params.layout.tensors() {
        let name = format!("grad.{}", t.name);
        grad_err = grad_err.max(assert_close(
            &format!("{label} {name}"),
            &grads[u][t.range.clone()],
            &expected(&fx, "grad", &t.name),
            1e-4,
        ));
    }

    // Five AdamW steps with clipping and a cosine schedule. Adam divides by sqrt(v), which
    // amplifies the tiny gradient differences above for entries whose gradient is near zero
    // (an entry's update is ±lr whatever its gradient's size), and torch's f32 sqrt is not
    // correctly rounded; the worst entry seen is 5.1e-4 of its tensor's scale (gemma2, whose
    // soft-caps flatten some gradients further; the other cases stay under 2e-4), so 1e-3
    // leaves room for another CPU's GEMM kernel while a wrong op (errors of order 1) still fails.
    let traj_loss = fx.f32s("traj.loss");
    let traj_norm = fx.f32s("traj.grad_norm");
    let traj_lr = fx.f32s("traj.lr");
    let traj_aux = fx.has("traj.aux_loss").then(|| fx.f32s("traj.aux_loss"));
    for k in 0..traj_loss.len() {
        let m = trainer.step(std::slice::from_ref(&mb)).expect("step");
        if let Some(traj_aux) = &traj_aux {
            let (got, want) = (m.aux_loss.expect("aux loss"), traj_aux[k] as f64);
            assert!(
                (got - want).abs() <= 1e-4 * want.abs(),
                "{label} step {k} aux {got} vs {want}"
            );
        }
        let (l, n) = (traj_loss[k] as f64, traj_norm[k] as f64);
        assert!((m.loss - l).abs() <= 1e-4 * l.abs(), "{label} step {k} loss {} vs {l}", m.loss);
        assert!(
            (m.grad_norm - n).abs() <= 1e-4 * n.abs(),
            "{label} step {k} grad norm {} vs {n}",
            m.grad_norm
        );
        assert!(
            (m.lr - traj_lr[k]).abs() <= 1e-7 * traj_lr[k].abs().max(1e-3),
            "{label} step {k} lr {} vs {}",
            m.lr,
            traj_lr[k]
        );
    }
    let mut final_err = 0f32;
    for (u, t) in params.layout.tensors() {
        let name = format!("final.{}", t.name);
        final_err = final_err.max(assert_close(
            &format!("{label} {name}"),
            &trainer.params.units[u][t.range.clone()],
            &expected(&fx, "final", &t.name),
            1e-3,
        ));
    }
    // Shown with --nocapture: the figures quoted for the CPU reference's agreement.
    eprintln!(
        "{label}: logits {logits_err:.1e}, loss {:.1e}{aux_err}, gradients {grad_err:.1e}, params after 5 steps {final_err:.1e} (max relative errors)",
        (loss - expected_loss).abs() / expected_loss.abs()
    );
}
