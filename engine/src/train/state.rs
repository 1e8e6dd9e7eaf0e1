//! The full training state for exact resume: master weights, Adam moments, the step count and
//! the position in the data. Saved as `OUT/state/`, an ordinary Hugging Face folder of the
//! master weights (transformers can load it) plus the moments (`adam_m.<name>`,
//! `adam_v.<name>`) and `trainer_state.json`; written atomically, so a crash leaves the previous
//! state intact. There is no other randomness to save: data order follows from the run's seed,
//! and nothing in a step draws random numbers.

use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::data::MicroBatch;
use crate::error::{Error, Result};
use crate::model::{HostParams, ModelLayout};
use crate::spec::ModelSpec;
use crate::weights::{
    DEFAULT_MAX_SHARD_BYTES, HfFolder, SaveDtype, TensorRef, TensorSource, save_hf_folder,
};

/// The run's options, in the run folder.
pub const RUN_FILE: &str = "run.json";
/// The latest full training state, in the run folder.
pub const STATE_DIR: &str = "state";
const TRAINER_FILE: &str = "trainer_state.json";

#[derive(Debug, Serialize, Deserialize)]
struct TrainerFile {
    format: u32,
    step: u64,
    cursor: usize,
    data_fingerprint: String,
}

/// Everything a run needs to continue exactly.
pub struct TrainingState {
    /// Optimizer steps taken.
    pub step: u64,
    /// Index of the next micro-batch.
    pub cursor: usize,
    /// Identifies the packed data, so a resume on changed data is refused.
    pub data_fingerprint: String,
    pub master: HostParams,
    pub m: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
}

impl TrainingState {
    pub fn save(&self, dir: &Path, spec: &ModelSpec) -> Result<()> {
        let layout = &self.master.layout;
        let mut tensors = self.master.tensor_refs();
        let names: Vec<(String, String)> = layout
            .tensors()
            .map(|(_, t)| (format!("adam_m.{}", t.name), format!("adam_v.{}", t.name)))
            .collect();
        for ((u, t), (m_name, v_name)) in layout.tensors().zip(&names) {
            let r = t.range.clone();
            tensors.push(TensorRef {
                name: m_name,
                shape: t.shape.clone(),
                data: &self.m[u][r.clone()],
            });
            tensors.push(TensorRef { name: v_name, shape: t.shape.clone(), data: &self.v[u][r] });
        }
        let trainer = TrainerFile {
            format: 1,
            step: self.step,
            cursor: self.cursor,
            data_fingerprint: self.data_fingerprint.clone(),
        };
        let trainer = serde_json::to_vec_pretty(&trainer)
            .map_err(|e| Error::invalid(format!("cannot write the trainer state: {e}")))?;
        save_hf_folder(
            dir,
            &HfFolder {
                tensors,
                dtype: SaveDtype::F32,
                max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
                config: spec.to_hf_config(),
                extra_files: vec![(TRAINER_FILE.into(), trainer)],
            },
        )
    }

    /// The step of the state saved in `dir`, without reading its tensors; `None` when no
    /// complete state is there (the folder is written atomically, so a present trainer file
    /// means a complete state).
    pub fn saved_step(dir: &Path) -> Result<Option<u64>> {
        let path = dir.join(TRAINER_FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io(&path, e)),
        };
        let trainer: TrainerFile = serde_json::from_str(&text)
            .map_err(|e| Error::invalid(format!("{}: not a trainer state: {e}", path.display())))?;
        Ok(Some(trainer.step))
    }

    pub fn load(dir: &Path, spec: &ModelSpec) -> Result<TrainingState> {
        let path = dir.join(TRAINER_FILE);
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let trainer: TrainerFile = serde_json::from_str(&text)
            .map_err(|e| Error::invalid(format!("{}: not a trainer state: {e}", path.display())))?;
        if trainer.format != 1 {
            return Err(Error::invalid(format!(
                "{}: unknown state format {}",
                path.display(),
                trainer.format
            )));
        }
        let source = TensorSource::open(dir)?;
        let master = HostParams::load(spec, &source)?;
        let layout: Arc<ModelLayout> = master.layout.clone();
        let mut m: Vec<Vec<f32>> = layout.units.iter().map(|u| vec![0.0; u.len]).collect();
        let mut v = m.clone();
        for (u, t) in layout.tensors() {
            source.read_f32_into(&format!("adam_m.{}", t.name), &mut m[u][t.range.clone()])?;
            source.read_f32_into(&format!("adam_v.{}", t.name), &mut v[u][t.range.clone()])?;
        }
        Ok(TrainingState {
            step: trainer.step,
            cursor: trainer.cursor,
            data_fingerprint: trainer.data_fingerprint,
            master,
            m,
            v,
        })
    }
}

/// FNV-1a over every token, target, position and document bound, in order.
pub fn data_fingerprint(batches: &[MicroBatch]) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |values: &[i32]| {
        for v in values {
            for byte in v.to_le_bytes() {
                hash ^= u64::from(byte);
                hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
    };
    for mb in batches {
        eat(&mb.ids);
        eat(&mb.targets);
        eat(&mb.positions);
        eat(&mb.cu_seqlens);
    }
    format!("{hash:016x}")
}
