//! Every CUDA kernel compiles through NVRTC for each GPU architecture Sluice supports, and the
//! kernels have no register spills. Runs without a GPU: only libnvrtc is needed, which
//! `scripts/test.sh` downloads (the `nvidia-cuda-nvrtc` wheel) into `.cache/nvrtc` and names in
//! `SLUICE_NVRTC_LIB`.

use std::path::{Path, PathBuf};

use sluice_engine::backend::cuda::compile::{SOURCES, compile, full_source, parse_ptxas_report};

const ARCHES: [&str; 4] = ["sm_80", "sm_86", "sm_89", "sm_90"];

/// Loads libnvrtc (and its builtins library beside it) from `SLUICE_NVRTC_LIB` so that the
/// backend's loader, which asks for the library by its usual name, finds it already loaded.
fn load_nvrtc() -> Vec<libloading::Library> {
    let lib = std::env::var_os("SLUICE_NVRTC_LIB").map(PathBuf::from).unwrap_or_else(|| {
        panic!(
            "SLUICE_NVRTC_LIB is not set: run scripts/test.sh, which downloads NVRTC \
             (nvidia-cuda-nvrtc==13.0.88) into .cache/nvrtc and sets it to libnvrtc.so.13"
        )
    });
    assert!(lib.is_file(), "SLUICE_NVRTC_LIB={} is not a file", lib.display());
    let dir = lib.parent().unwrap_or(Path::new("."));
    let builtins = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libnvrtc-builtins.so"))
        });
    let mut loaded = Vec::new();
    for path in builtins.chain([lib]) {
        // SAFETY: loading NVIDIA's NVRTC libraries runs only their own initialisers.
        let l = unsafe { libloading::Library::new(&path) }
            .unwrap_or_else(|e| panic!("loading {}: {e}", path.display()));
        loaded.push(l);
    }
    loaded
}

/// The report lines for every entry point of every module on `arch`; panics on a compile error,
/// a missing report or a spill.
fn check_arch(arch: &str) -> Vec<String> {
    let mut table = Vec::new();
    for k in SOURCES {
        let compiled = compile(k.name, &full_source(k), arch, true)
            .unwrap_or_else(|e| panic!("{} for {arch}: {e}", k.name));
        assert!(!compiled.cubin.is_empty());
        let usage = parse_ptxas_report(&compiled.log);
        for entry in k.entry_points {
            let u = usage.iter().find(|u| u.function == *entry).unwrap_or_else(|| {
                panic!("{}: no ptxas report for {entry} on {arch}:\n{}", k.name, compiled.log)
            });
            assert!(
                u.spill_store_bytes == 0 && u.spill_load_bytes == 0,
                "{entry} on {arch} spills registers: {u:?}"
            );
            table.push(format!(
                "{arch} {entry:<28} {:>3} registers, {:>4} bytes stack",
                u.registers, u.stack_bytes
            ));
        }
    }
    table
}

#[test]
fn every_kernel_compiles_for_every_target_without_spills() {
    let _nvrtc = load_nvrtc();
    // One thread per architecture: NVRTC programs are independent, and ptxas dominates.
    let tables: Vec<Vec<String>> = std::thread::scope(|s| {
        let handles: Vec<_> =
            ARCHES.iter().map(|&arch| s.spawn(move || check_arch(arch))).collect();
        handles.into_iter().map(|h| h.join().expect("a compile thread panicked")).collect()
    });
    // Shown with --nocapture.
    println!("{}", tables.concat().join("\n"));
}
