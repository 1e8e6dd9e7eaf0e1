//! The full training state for exact resume: master weights, Adam moments, the step count and
//! the position in the data. Saved as `OUT/state/`, an ordinary Hugging Face folder of the
//! master weights (transformers can load it) plus the moments (`adam_m.<name>`,
//! `adam_v.<name>`) and `trainer_state.json`; written atomically, so a crash leaves the previous
//! state intact. There is no other randomness to save: data order follows from the run's seed,
//! and nothing in a step draws random numbers.

use std::path::Path;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::data::MicroBatch;
use crate::error::{Error, Result};
use crate::model::{HostParams, ModelLayout};
use crate::spec::ModelSpec;
use crate::store::HostStore;
use crate::weights::{
    DEFAULT_MAX_SHARD_BYTES, HfFolder, Passthrough, SaveDtype, TensorData, TensorRef, TensorSource,
    save_hf_folder,
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

/// Where a run stands: what a saved state records besides the tensors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Position {
    /// Optimizer steps taken.
    pub step: u64,
    /// Index of the next micro-batch.
    pub cursor: usize,
    /// Identifies the packed data, so a resume on changed data is refused.
    pub data_fingerprint: String,
}

/// A saved state, opened: the position, the master weights, and the moments still in their
/// files (read a unit at a time into the host store or the disk tier by
/// [`TrainingState::fill_moments`], so a resume holds no second copy of them).
pub struct TrainingState {
    pub position: Position,
    pub master: HostParams,
    source: TensorSource,
}

/// Reads the training state out of a settled host store, a tensor chunk at a time: the master
/// from each unit's slab, the moments from host memory or, a unit at a time, from the disk
/// tier.
struct StoreReader<'a> {
    store: &'a HostStore,
    /// The last disk unit read.
    disk: Mutex<Option<CachedUnit>>,
}

/// A disk unit's moments: (unit, m, v).
type CachedUnit = (usize, Vec<f32>, Vec<f32>);

#[derive(Clone, Copy)]
enum Array {
    Master,
    M,
    V,
}

impl StoreReader<'_> {
    fn read(&self, unit: usize, array: Array, start: usize, out: &mut [f32]) -> Result<()> {
        let end = start + out.len();
        let short = || Error::invalid(format!("unit {unit} is shorter than its layout"));
        let on_disk = self.store.disk().is_some_and(|d| d.tier().holds(unit));
        match array {
            Array::Master => {
                let state = self.store.lock(unit)?;
                out.copy_from_slice(state.master.as_f32().get(start..end).ok_or_else(short)?);
            }
            Array::M | Array::V if !on_disk => {
                let state = self.store.lock(unit)?;
                let src = if matches!(array, Array::M) { &state.m } else { &state.v };
                out.copy_from_slice(src.get(start..end).ok_or_else(short)?);
            }
            Array::M | Array::V => {
                let mut cache = self
                    .disk
                    .lock()
                    .map_err(|_| Error::invalid("the state reader's cache was poisoned"))?;
                if cache.as_ref().is_none_or(|(u, _, _)| *u != unit) {
                    *cache = None;
                    let read =
                        self.store.with_moments(unit, |m, v| Ok((unit, m.to_vec(), v.to_vec())))?;
                    *cache = Some(read);
                }
                let (_, m, v) = cache.as_ref().ok_or_else(short)?;
                let src = if matches!(array, Array::M) { m } else { v };
                out.copy_from_slice(src.get(start..end).ok_or_else(short)?);
            }
        }
        Ok(())
    }
}

/// Per tensor of `layout`, a reader of one array of its unit in `store`.
type Readers<'a> = Vec<Box<dyn Fn(usize, &mut [f32]) -> Result<()> + Sync + 'a>>;

fn readers<'a>(reader: &'a StoreReader<'a>, layout: &ModelLayout, array: Array) -> Readers<'a> {
    layout
        .tensors()
        .map(|(u, t)| {
            let base = t.range.start;
            Box::new(move |start: usize, out: &mut [f32]| reader.read(u, array, base + start, out))
                as Box<dyn Fn(usize, &mut [f32]) -> Result<()> + Sync>
        })
        .collect()
}

/// The master weights of a settled host store as tensors to write, read as they are written.
fn master_refs<'a>(layout: &'a ModelLayout, readers: &'a Readers<'_>) -> Vec<TensorRef<'a>> {
    layout
        .tensors()
        .zip(readers)
        .map(|((_, t), read)| TensorRef {
            name: &t.name,
            shape: t.shape.clone(),
            data: TensorData::Read { len: t.range.len(), read: &**read },
        })
        .collect()
}

/// Writes the master weights held in a settled host store as a checkpoint folder, without a
/// copy of them in memory; with `passthrough` (a multimodal model's), as the wrapper's folder.
pub fn save_checkpoint_from(
    dir: &Path,
    store: &HostStore,
    layout: &ModelLayout,
    config: serde_json::Value,
    extra_files: Vec<(String, Vec<u8>)>,
    dtype: SaveDtype,
    passthrough: Option<&Passthrough>,
) -> Result<()> {
    let reader = StoreReader { store, disk: Mutex::new(None) };
    let master = readers(&reader, layout, Array::Master);
    let folder = HfFolder {
        tensors: master_refs(layout, &master),
        dtype,
        max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
        config,
        extra_files,
    };
    match passthrough {
        Some(p) => p.save(dir, folder),
        None => save_hf_folder(dir, &folder),
    }
}

impl TrainingState {
    /// Saves the state held in a settled host store (the optimizer idle) as `dir`, reading it
    /// a tensor chunk at a time: the host holds at most one disk unit's moments besides.
    pub fn save(
        dir: &Path,
        spec: &ModelSpec,
        store: &HostStore,
        layout: &ModelLayout,
        position: &Position,
    ) -> Result<()> {
        let reader = StoreReader { store, disk: Mutex::new(None) };
        let master = readers(&reader, layout, Array::Master);
        let (m, v) = (readers(&reader, layout, Array::M), readers(&reader, layout, Array::V));
        let mut tensors = master_refs(layout, &master);
        let names: Vec<(String, String)> = layout
            .tensors()
            .map(|(_, t)| (format!("adam_m.{}", t.name), format!("adam_v.{}", t.name)))
            .collect();
        // m and v of each tensor side by side: a disk unit's moments are read once for both.
        for (((_, t), (m_name, v_name)), (m, v)) in
            layout.tensors().zip(&names).zip(m.iter().zip(&v))
        {
            let len = t.range.len();
            tensors.push(TensorRef {
                name: m_name,
                shape: t.shape.clone(),
                data: TensorData::Read { len, read: &**m },
            });
            tensors.push(TensorRef {
                name: v_name,
                shape: t.shape.clone(),
                data: TensorData::Read { len, read: &**v },
            });
        }
        let trainer = TrainerFile {
            format: 1,
            step: position.step,
            cursor: position.cursor,
            data_fingerprint: position.data_fingerprint.clone(),
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

    /// Opens the state saved in `dir`: its position and master weights; the moments stay in
    /// their files until [`TrainingState::fill_moments`].
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
        Ok(TrainingState {
            position: Position {
                step: trainer.step,
                cursor: trainer.cursor,
                data_fingerprint: trainer.data_fingerprint,
            },
            master,
            source,
        })
    }

    /// Reads unit `unit`'s saved moments into `m` and `v` (each the unit's length).
    pub fn fill_moments(
        &self,
        layout: &ModelLayout,
        unit: usize,
        m: &mut [f32],
        v: &mut [f32],
    ) -> Result<()> {
        let u = layout
            .units
            .get(unit)
            .ok_or_else(|| Error::invalid(format!("the saved state has no unit {unit}")))?;
        if m.len() < u.len || v.len() < u.len {
            return Err(Error::invalid(format!(
                "the saved moments of unit {unit} do not fit its {} values",
                m.len()
            )));
        }
        for t in &u.tensors {
            self.source.read_f32_into(&format!("adam_m.{}", t.name), &mut m[t.range.clone()])?;
            self.source.read_f32_into(&format!("adam_v.{}", t.name), &mut v[t.range.clone()])?;
        }
        Ok(())
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
