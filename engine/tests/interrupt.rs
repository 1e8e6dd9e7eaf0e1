//! A CPU run asked to stop in the middle of a step abandons it between micro-batches, saves
//! the state of the last finished step, and a resume from there ends exactly where an
//! uninterrupted run ends.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use sluice_engine::backend::cpu::Cpu;
use sluice_engine::data::DatasetSource;
use sluice_engine::model::HostParams;
use sluice_engine::train::{
    Devices, Event, Interrupt, Job, JobSettings, ModelSource, Observer, RunOptions, STATE_DIR,
    TrainingState,
};
use sluice_engine::weights::SaveDtype;

const STEPS: u64 = 3;

/// Records losses; with `stop_after`, asks to stop once that many interrupt checks have been
/// made after step 1 ended (so in the middle of step 2).
struct Watcher {
    losses: Vec<(u64, f64)>,
    stop_after: Option<usize>,
    /// Checks made since step 1 ended; `usize::MAX` before.
    checks: Arc<AtomicUsize>,
}

impl Watcher {
    fn new(stop_after: Option<usize>) -> Watcher {
        Watcher { losses: Vec::new(), stop_after, checks: Arc::new(AtomicUsize::new(usize::MAX)) }
    }
}

impl Observer for Watcher {
    fn event(&mut self, event: &Event) {
        if let Event::Step(m) = event {
            self.losses.push((m.step, m.loss));
            if m.step == 1 {
                self.checks.store(0, Ordering::SeqCst);
            }
        }
    }

    fn interrupt(&self) -> Option<Interrupt> {
        let stop_after = self.stop_after?;
        let checks = self.checks.clone();
        Some(Arc::new(move || {
            let seen = checks.load(Ordering::SeqCst);
            if seen == usize::MAX {
                return false;
            }
            checks.fetch_add(1, Ordering::SeqCst);
            seen >= stop_after
        }))
    }
}

fn options(out: &Path) -> RunOptions {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("../datasets/demo-alpaca.jsonl");
    let job = Job {
        model: ModelSource::Preset("tiny".into()),
        data: DatasetSource::File(data),
        eval_data: None,
        devices: Devices::Cpu,
        settings: JobSettings {
            seq_len: 64,
            micro_batch: 2,
            grad_accum: 4,
            steps: Some(STEPS),
            seed: 3,
            save_dtype: SaveDtype::F32,
            ..JobSettings::default()
        },
    };
    RunOptions::unplanned(job, out.to_path_buf()).expect("a plan-free placement")
}

fn weights(dir: &Path) -> Vec<Vec<f32>> {
    HostParams::load_dir(dir).expect("checkpoint loads").1.units
}

#[test]
fn a_step_interrupted_midway_is_dropped_and_the_resume_is_exact() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let (whole, cut) = (tmp.path().join("whole"), tmp.path().join("cut"));

    let mut plain = Watcher::new(None);
    let summary = sluice_engine::train::run(&Cpu::new(), &options(&whole), false, &mut plain)
        .expect("uninterrupted run");
    assert_eq!(summary.steps, STEPS);

    // Stopped a few micro-batches into step 2: only step 1 counts, and its state is saved.
    let mut stopper = Watcher::new(Some(5));
    let summary = sluice_engine::train::run(&Cpu::new(), &options(&cut), false, &mut stopper)
        .expect("interrupted run");
    assert_eq!(summary.steps, 1, "{:?}", stopper.losses);
    assert_eq!(stopper.losses.len(), 1);
    assert!(stopper.checks.load(Ordering::SeqCst) > 5, "the check was never made mid-step");
    assert!(cut.join("checkpoint-1").is_dir() && !cut.join("final").exists());
    let state = TrainingState::saved_step(&cut.join(STATE_DIR)).expect("state readable");
    assert_eq!(state, Some(1));

    let mut resumed = Watcher::new(None);
    let summary = sluice_engine::train::run(&Cpu::new(), &options(&cut), true, &mut resumed)
        .expect("resumed run");
    assert_eq!(summary.steps, STEPS);
    assert_eq!(resumed.losses, plain.losses[1..].to_vec(), "steps 2.. differ");
    assert_eq!(weights(&cut.join("final")), weights(&whole.join("final")), "not bit for bit");
}
