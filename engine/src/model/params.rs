//! Host-side parameter slabs: random initialisation, loading from Hugging Face weights, and the
//! tensor list an export writes.

use std::path::Path;
use std::sync::Arc;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use super::layout::ModelLayout;
use crate::error::{Error, Result};
use crate::spec::ModelSpec;
use crate::weights::{TensorRef, TensorSource};

/// Standard deviation of the normal initialisation of matrices, transformers'
/// `initializer_range` default for every supported family.
const INIT_STD: f32 = 0.02;
/// Values one initialisation task draws (even, so no Box–Muller pair straddles two tasks).
const INIT_CHUNK: usize = 1 << 20;

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
    /// biases 0. Deterministic for a seed, whatever the number of threads: tensor `i` draws from
    /// ChaCha8 stream `i` of the seed, and each chunk of it starts at its own position in that
    /// stream, so chunks fill in parallel (a 7B model in seconds) into the one copy returned.
    pub fn random(spec: &ModelSpec, seed: u64) -> HostParams {
        let mut p = HostParams::zeros(Arc::new(ModelLayout::new(spec)));
        let layout = p.layout.clone();
        // (unit, range, stream) of every matrix; norms and biases are cheap and filled here.
        let mut matrices: Vec<Vec<(std::ops::Range<usize>, u64)>> = vec![Vec::new(); p.units.len()];
        for (stream, (u, t)) in layout.tensors().enumerate() {
            if t.shape.len() >= 2 {
                matrices[u].push((t.range.clone(), stream as u64));
            } else if t.name.ends_with("norm.weight") || t.name.ends_with("layernorm.weight") {
                // A norm scales by `offset + w`: Gemma's weights start at 0, the others' at 1.
                p.units[u][t.range.clone()].fill(1.0 - spec.norm_offset);
            }
        }
        p.units.par_iter_mut().zip(matrices).for_each(|(unit, tensors)| {
            for (range, stream) in tensors {
                unit[range].par_chunks_mut(INIT_CHUNK).enumerate().for_each(|(i, chunk)| {
                    let mut rng = ChaCha8Rng::seed_from_u64(seed);
                    rng.set_stream(stream);
                    // Each pair of values takes two f64 draws of two 32-bit words each.
                    rng.set_word_pos(2 * (i * INIT_CHUNK) as u128);
                    fill_normal(chunk, INIT_STD, &mut rng);
                });
            }
        });
        p
    }

    /// Reads every tensor of the layout from `source` by its Hugging Face name, converting to
    /// f32 (and dequantising MXFP4 experts) straight into the slabs, a tensor at a time, so
    /// loading needs no memory beyond the slabs. A tied model ignores a stored
    /// `lm_head.weight`; any other missing tensor or shape mismatch is an error naming the
    /// tensor.
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
            source.read_f32_into(&t.name, &mut p.units[u][t.range.clone()])?;
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
                data: self.units[u][t.range.clone()].into(),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_drawn_in_parallel_equal_one_serial_draw_of_the_stream() {
        let n = 2 * INIT_CHUNK + 6;
        let mut serial = vec![0.0f32; n];
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        rng.set_stream(3);
        fill_normal(&mut serial, 1.0, &mut rng);
        let mut chunked = vec![0.0f32; n];
        chunked.par_chunks_mut(INIT_CHUNK).enumerate().for_each(|(i, chunk)| {
            let mut rng = ChaCha8Rng::seed_from_u64(7);
            rng.set_stream(3);
            rng.set_word_pos(2 * (i * INIT_CHUNK) as u128);
            fill_normal(chunk, 1.0, &mut rng);
        });
        assert!(serial == chunked, "a chunk's draws depend on how the tensor was cut");
        // And they are standard normal: mean 0, variance 1, within 5 standard errors.
        let mean = serial.iter().map(|&x| f64::from(x)).sum::<f64>() / n as f64;
        let var = serial.iter().map(|&x| (f64::from(x) - mean).powi(2)).sum::<f64>() / n as f64;
        let se = 1.0 / (n as f64).sqrt();
        assert!(mean.abs() < 5.0 * se, "mean {mean}");
        assert!((var - 1.0).abs() < 5.0 * 2f64.sqrt() * se, "variance {var}");
    }

    #[test]
    fn random_init_is_deterministic_and_shaped_like_transformers() {
        let spec = crate::spec::preset("tiny").expect("preset");
        let a = HostParams::random(&spec, 1);
        assert_eq!(a, HostParams::random(&spec, 1));
        assert_ne!(a, HostParams::random(&spec, 2));
        let norm = a.get("model.norm.weight").expect("final norm");
        assert!(norm.iter().all(|&x| x == 1.0));
        let q = a.get("model.layers.0.self_attn.q_proj.weight").expect("q");
        let std = (q.iter().map(|&x| x * x).sum::<f32>() / q.len() as f32).sqrt();
        assert!((std - INIT_STD).abs() < 0.1 * INIT_STD, "std {std}");
        // Two matrices of the same shape draw from different streams.
        let k = a.get("model.layers.1.self_attn.q_proj.weight").expect("q of layer 1");
        assert_ne!(q, k);
    }
}
