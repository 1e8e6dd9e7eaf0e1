//! The CUDA backend against the CPU reference, on the GPU machine (declared `test = false`: CI
//! has no GPU). Run: `cargo test --release -p sluice-engine --test gpu -- --test-threads 1
//! --nocapture`; the last test prints the largest relative error of every op.
//!
//! Method: fresh random inputs with odd sizes; inputs the GPU stores in bf16 are rounded to bf16
//! first and the CPU op runs on the same rounded values, so the difference is the GPU's own
//! rounding (bf16 outputs: 2^-9 of each element, ~3 decimal digits) and f32 summation order.
//! Outputs are poisoned with NaN beforehand, so an element a kernel forgets to write fails.
//! Errors are `max |gpu - cpu| / max |cpu|` over the tensor (relative to its scale); each
//! tolerance is stated where it is used. One rounding to bf16 moves an element by at most half
//! an ulp, 2^-8 = 3.9e-3 of the tensor's scale: hence 4e-3 for ops computed exactly in f32 and
//! rounded once, 5e-3 where transcendental functions (exp, sin, cos) differ by an f32 ulp
//! between the GPU and the host and can tip a rounding.
//!
//! One binary, a file per op family; `common` holds what they share.

#[path = "../support/cases.rs"]
mod cases;
mod common;

mod attention;
mod decode;
mod elementwise;
mod loss;
mod matmul;
mod moe;
mod norm;
mod parallel;
mod speed;
mod step;

use common::table;

#[test]
fn zzz_parity_table() {
    let t = table().lock().expect("table");
    println!("\n| check | largest relative error | tolerance |\n| --- | --- | --- |");
    for (what, (err, tol)) in t.iter() {
        println!("| {what} | {err:.2e} | {tol:.0e} |");
    }
}
