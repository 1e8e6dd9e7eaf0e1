//! Host-side parameter slabs: random initialisation, loading from Hugging Face weights, and the
//! tensor list an export writes.

use std::path::Path;
use std::sync::Arc;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::layout::ModelLayout;
use crate::error::{Error, Result};
use crate::spec::ModelSpec;
use crate::weights::{TensorRef, TensorSource};

/// Standard deviation of the normal initialisation of matrices, transformers'
/// `initializer_range` default for every supported family.
const INIT_STD: f32 = 0.02;

/// One f32 slab per unit, laid out by [`ModelLayout`].
#[derive(Debug, Clone, PartialEq)]
pub struct HostParams {
    pub layout: Arc<ModelLayout>,
    pub units: Vec<Vec<f32>>,
}

impl HostParams {
    /// Zero-filled slabs (padding stays zero forever).
    pub fn zeros(layout: Arc<ModelLayout>) -> HostParams {
        let units = layout.units.iter().map(|u| vec![0.0; u.len]).collect();
        HostParams { layout, units }
    }

    /// Random initialisation as transformers does it: matrices ~ N(0, 0.02), norm weights 1,
    /// biases 0. Deterministic for a seed.
    pub fn random(spec: &ModelSpec, seed: u64) -> HostParams {
        let mut p = HostParams::zeros(Arc::new(ModelLayout::new(spec)));
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let layout = p.layout.clone();
        for (u, t) in layout.tensors() {
            let dst = &mut p.units[u][t.range.clone()];
            if t.shape.len() >= 2 {
                fill_normal(dst, INIT_STD, &mut rng);
            } else if t.name.ends_with("norm.weight") || t.name.ends_with("layernorm.weight") {
                dst.fill(1.0);
            }
        }
        p
    }

    /// Reads every tensor of the layout from `source` by its Hugging Face name, converting to
    /// f32. A tied model ignores a stored `lm_head.weight`; any other missing tensor or shape
    /// mismatch is an error naming the tensor.
    pub fn load(spec: &ModelSpec, source: &TensorSource) -> Result<HostParams> {
        let mut p = HostParams::zeros(Arc::new(ModelLayout::new(spec)));
        let layout = p.layout.clone();
        for (u, t) in layout.tensors() {
            let shape = source.shape(&t.name)?;
            if shape != t.shape {
                return Err(Error::weights(
                    source.path(),
                    format!(
                        "tensor {} has shape {:?} but config.json implies {:?}",
                        t.name, shape, t.shape
                    ),
                ));
            }
            let data = source.read_f32(&t.name)?;
            p.units[u][t.range.clone()].copy_from_slice(&data);
        }
        Ok(p)
    }

    /// Loads a model folder: its `config.json` and weights.
    pub fn load_dir(dir: &Path) -> Result<(ModelSpec, HostParams)> {
        let spec = ModelSpec::from_path(dir)?;
        let source = TensorSource::open(dir)?;
        let params = HostParams::load(&spec, &source)?;
        Ok((spec, params))
    }

    /// Every tensor as a borrowed view, in Hugging Face order, for writing.
    pub fn tensor_refs(&self) -> Vec<TensorRef<'_>> {
        self.layout
            .tensors()
            .map(|(u, t)| TensorRef {
                name: &t.name,
                shape: t.shape.clone(),
                data: &self.units[u][t.range.clone()],
            })
            .collect()
    }

    /// The data of one tensor by its Hugging Face name.
    pub fn get(&self, name: &str) -> Option<&[f32]> {
        self.layout
            .tensors()
            .find(|(_, t)| t.name == name)
            .map(|(u, t)| &self.units[u][t.range.clone()])
    }
}

/// Normal samples by Box–Muller from a seeded stream, so initialisation needs no extra crate and
/// is identical on every machine.
fn fill_normal(dst: &mut [f32], std: f32, rng: &mut ChaCha8Rng) {
    use rand::Rng;
    for pair in dst.chunks_mut(2) {
        let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
        let u2: f64 = rng.random::<f64>();
        let r = (-2.0 * u1.ln()).sqrt();
        let theta = 2.0 * std::f64::consts::PI * u2;
        pair[0] = (r * theta.cos()) as f32 * std;
        if let Some(second) = pair.get_mut(1) {
            *second = (r * theta.sin()) as f32 * std;
        }
    }
}
