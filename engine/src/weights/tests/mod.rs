//! Tests of reading and writing, through files on disk: round trips, every error the reader
//! promises, and the folder swap.

mod folder;
mod multimodal;
mod mxfp4;
mod read_errors;
mod round_trip;

use std::path::{Path, PathBuf};

use safetensors::tensor::TensorView;

use crate::error::Error;
use crate::weights::{Dtype, TensorRef};

type TestResult = std::result::Result<(), Box<dyn std::error::Error>>;

fn tempdir() -> std::io::Result<tempfile::TempDir> {
    tempfile::tempdir()
}

/// Deterministic, varied values: signs, magnitudes from 1e-3 to 1e3, no two alike.
fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = (i as f32 + 1.0) * 0.618_034 + seed as f32 * 0.754_877;
            let sign = if (i + seed as usize).is_multiple_of(3) { -1.0 } else { 1.0 };
            sign * x.fract() * 10f32.powi((i % 7) as i32 - 3)
        })
        .collect()
}

fn tensor<'a>(name: &'a str, shape: &[usize], data: &'a [f32]) -> TensorRef<'a> {
    TensorRef { name, shape: shape.to_vec(), data: data.into() }
}

/// A safetensors file made by the safetensors crate itself, for dtypes Sluice never writes.
fn serialize_with_crate(
    tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)],
) -> Result<Vec<u8>, Box<dyn std::error::Error>> {
    let mut views = Vec::new();
    for (name, dtype, shape, bytes) in tensors {
        views.push((*name, TensorView::new(*dtype, shape.clone(), bytes)?));
    }
    Ok(safetensors::serialize(views, None)?)
}

/// Unwraps a `Weights` error into (path, message), failing the test on anything else.
fn weights_error<T: std::fmt::Debug>(result: crate::Result<T>) -> (PathBuf, String) {
    match result {
        Err(Error::Weights { path, message }) => (path, message),
        other => panic!("expected a weights error, got {other:?}"),
    }
}

fn invalid_error<T: std::fmt::Debug>(result: crate::Result<T>) -> String {
    match result {
        Err(Error::Invalid(message)) => message,
        other => panic!("expected an invalid-option error, got {other:?}"),
    }
}

/// The names in a folder, sorted.
fn listing(dir: &Path) -> std::io::Result<Vec<String>> {
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        names.push(entry?.file_name().to_string_lossy().into_owned());
    }
    names.sort();
    Ok(names)
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|x| x.to_bits()).collect()
}
