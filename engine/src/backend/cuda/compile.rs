//! NVRTC compilation of the kernels to machine code for one GPU architecture, the on-disk cache
//! of the results, and the reading of `ptxas`'s resource report (registers, spills), which the
//! kernel compile check uses without a GPU.
//!
//! Kernels are header-free CUDA C (NVRTC 13 ships no headers), one module per source file, each
//! compiled with the shared prelude `kernels/common.cuh` in front of it.

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};

use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};

use crate::error::{Error, Result};

/// One kernel source file and the entry points it defines.
#[derive(Debug, Clone, Copy)]
pub struct KernelSource {
    /// Module name, used in messages and cache file names.
    pub name: &'static str,
    pub source: &'static str,
    /// Every `extern "C" __global__` function the file defines.
    pub entry_points: &'static [&'static str],
}

const COMMON: &str = include_str!("kernels/common.cuh");

/// Every kernel module the backend loads.
pub const SOURCES: &[KernelSource] = &[
    KernelSource {
        name: "elementwise",
        source: include_str!("kernels/elementwise.cu"),
        entry_points: &[
            "add",
            "add_assign",
            "convert",
            "sum_partials",
            "bias_forward",
            "colsum_partials",
            "colsum_finish",
            "glu_forward",
            "glu_backward",
            "glu_forward_vec",
            "glu_backward_vec",
            "rope",
            "rope_vec",
            "embedding_forward",
            "embedding_backward",
        ],
    },
    KernelSource {
        name: "norm",
        source: include_str!("kernels/norm.cu"),
        entry_points: &[
            "rmsnorm_forward",
            "rmsnorm_backward",
            "rmsnorm_forward_vec",
            "rmsnorm_backward_vec",
        ],
    },
    KernelSource {
        name: "attention",
        source: include_str!("kernels/attention.cu"),
        entry_points: &[
            "attention_backward_dot",
            "attention_forward_32",
            "attention_forward_64",
            "attention_forward_128",
            "attention_forward_256",
            "attention_backward_dq_32",
            "attention_backward_dq_64",
            "attention_backward_dq_128",
            "attention_backward_dq_256",
            "attention_backward_dkv_32",
            "attention_backward_dkv_64",
            "attention_backward_dkv_128",
            "attention_backward_dkv_256",
            "attention_forward_capped_32",
            "attention_forward_capped_64",
            "attention_forward_capped_128",
            "attention_forward_capped_256",
            "attention_backward_dq_capped_32",
            "attention_backward_dq_capped_64",
            "attention_backward_dq_capped_128",
            "attention_backward_dq_capped_256",
            "attention_backward_dkv_capped_32",
            "attention_backward_dkv_capped_64",
            "attention_backward_dkv_capped_128",
            "attention_backward_dkv_capped_256",
            "flash_forward_64",
            "flash_forward_80",
            "flash_forward_96",
            "flash_forward_128",
            "flash_forward_256",
            "flash_backward_dq_64",
            "flash_backward_dq_80",
            "flash_backward_dq_96",
            "flash_backward_dq_128",
            "flash_backward_dq_256",
            "flash_backward_dkv_64",
            "flash_backward_dkv_80",
            "flash_backward_dkv_96",
            "flash_backward_dkv_128",
            "flash_backward_dv_256",
            "flash_backward_dk_256",
            "flash_backward_fused_64",
            "flash_backward_fused_128",
            "hopper_forward_64",
            "hopper_forward_128",
            "hopper_backward_dq_64",
            "hopper_backward_dq_128",
            "hopper_backward_dkv_64",
            "hopper_backward_dkv_128",
            "attention_sinks_forward",
            "attention_sinks_backward",
        ],
    },
    KernelSource {
        name: "loss",
        source: include_str!("kernels/loss.cu"),
        entry_points: &[
            "cross_entropy_rows",
            "cross_entropy_grad_rows",
            "cross_entropy_loss_grad_rows",
        ],
    },
    KernelSource {
        name: "decode",
        source: include_str!("kernels/decode.cu"),
        entry_points: &[
            "attention_decode_32",
            "attention_decode_64",
            "attention_decode_128",
            "attention_decode_256",
        ],
    },
    KernelSource {
        name: "moe",
        source: include_str!("kernels/moe.cu"),
        entry_points: &[
            "moe_route",
            "moe_route_backward",
            "moe_count",
            "moe_count_stats",
            "moe_sort_bounds",
            "moe_sort_scatter",
            "moe_gather",
            "moe_gather_backward",
            "moe_combine",
            "moe_combine_backward_dy",
            "moe_combine_backward_dw",
            "grouped_bias_forward",
            "sigmoid_gate_forward",
            "sigmoid_gate_backward",
        ],
    },
];

/// The full text NVRTC compiles for `k`: the shared prelude, then the file.
pub fn full_source(k: &KernelSource) -> String {
    format!("{COMMON}\n{}", k.source)
}

/// Machine code for one module and NVRTC's log (with `ptxas`'s report when asked for).
#[derive(Debug, Clone)]
pub struct Compiled {
    pub cubin: Vec<u8>,
    pub log: String,
}

fn err(message: impl std::fmt::Display) -> Error {
    Error::Backend { backend: "cuda".into(), message: format!("nvrtc: {message}") }
}

/// Fails with a clear message when libnvrtc cannot be loaded (every NVRTC call would panic).
pub fn nvrtc_present() -> Result<()> {
    // SAFETY: only tries to dlopen the library under its usual names.
    if unsafe { nvrtc_sys::is_culib_present() } {
        Ok(())
    } else {
        Err(err(
            "libnvrtc not found (install the CUDA 13 toolkit or the nvidia-cuda-nvrtc wheel and \
             put its lib directory on LD_LIBRARY_PATH)",
        ))
    }
}

/// NVRTC's version, `(major, minor)`.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    nvrtc_present()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present (checked above); both pointers are valid for writes.
    let status = unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) };
    status.result().map_err(|e| err(format!("nvrtcVersion: {e:?}")))?;
    Ok((major, minor))
}

/// The target a device of architecture `arch` gets: Hopper's arch-specific `sm_90a`, whose
/// warpgroup MMAs the Hopper attention kernels use (such a cubin runs on sm_90 devices only,
/// which is what it is built for), else `arch` itself.
pub fn target(arch: &str) -> &str {
    if arch == "sm_90" { "sm_90a" } else { arch }
}

/// Options every module is compiled with, for the real architecture `arch` (e.g. `sm_90`).
fn options(arch: &str, ptxas_report: bool) -> Vec<String> {
    let mut opts = vec![format!("--gpu-architecture={}", target(arch)), "--std=c++17".into()];
    if ptxas_report {
        opts.push("--ptxas-options=-v".into());
    }
    opts
}

/// Compiles `source` (named `name` in messages) to a cubin for `arch`.
pub fn compile(name: &str, source: &str, arch: &str, ptxas_report: bool) -> Result<Compiled> {
    nvrtc_present()?;
    let src = CString::new(source).map_err(|_| err(format!("{name}: source holds a NUL byte")))?;
    let cname = CString::new(format!("{name}.cu")).map_err(|_| err("bad module name"))?;
    let prog = nvrtc::create_program(&src, Some(&cname))
        .map_err(|e| err(format!("{name}: create program: {e:?}")))?;
    let opts = options(arch, ptxas_report);
    // SAFETY: `prog` was just created and is destroyed once below; the options are plain strings.
    let compiled = unsafe { nvrtc::compile_program(prog, &opts) };
    // SAFETY: `prog` is a live program.
    let log = unsafe { nvrtc::get_program_log(prog) }
        .map(|raw| {
            // SAFETY: NVRTC's log is NUL-terminated.
            unsafe { CStr::from_ptr(raw.as_ptr()) }.to_string_lossy().into_owned()
        })
        .unwrap_or_default();
    let cubin = compiled
        .map_err(|e| err(format!("{name} for {arch}: {e:?}\n{log}")))
        .and_then(|()| get_cubin(prog).map_err(|e| err(format!("{name} for {arch}: {e}"))));
    // SAFETY: `prog` is live and not used after this.
    let destroyed = unsafe { nvrtc::destroy_program(prog) };
    let cubin = cubin?;
    destroyed.map_err(|e| err(format!("{name}: destroy program: {e:?}")))?;
    Ok(Compiled { cubin, log })
}

fn get_cubin(prog: nvrtc_sys::nvrtcProgram) -> std::result::Result<Vec<u8>, String> {
    let mut size = 0usize;
    // SAFETY: `prog` was compiled successfully; `size` is valid for writes.
    unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size) }
        .result()
        .map_err(|e| format!("nvrtcGetCUBINSize: {e:?}"))?;
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` has the `size` bytes NVRTC reported.
    unsafe { nvrtc_sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast()) }
        .result()
        .map_err(|e| format!("nvrtcGetCUBIN: {e:?}"))?;
    if cubin.is_empty() {
        return Err("NVRTC produced no machine code".into());
    }
    Ok(cubin)
}

/// `ptxas`'s report on one function.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Usage {
    pub function: String,
    pub registers: u32,
    pub stack_bytes: u64,
    pub spill_store_bytes: u64,
    pub spill_load_bytes: u64,
}

/// Reads the `--ptxas-options=-v` report out of an NVRTC log: for each function, its
/// "Function properties" line (stack, spills) and the "Used N registers" line after it.
pub fn parse_ptxas_report(log: &str) -> Vec<Usage> {
    let number_before = |line: &str, what: &str| -> u64 {
        line.find(what)
            .and_then(|at| line[..at].split_whitespace().last())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    let mut out: Vec<Usage> = Vec::new();
    for line in log.lines() {
        if let Some(at) = line.find("Function properties for ") {
            let function = line[at + "Function properties for ".len()..].trim().to_string();
            out.push(Usage {
                function,
                registers: 0,
                stack_bytes: 0,
                spill_store_bytes: 0,
                spill_load_bytes: 0,
            });
        } else if let Some(u) = out.last_mut() {
            if line.contains("bytes spill stores") {
                u.stack_bytes = number_before(line, "bytes stack frame");
                u.spill_store_bytes = number_before(line, "bytes spill stores");
                u.spill_load_bytes = number_before(line, "bytes spill loads");
            } else if line.contains("Used") && line.contains("registers") {
                u.registers = number_before(line, "registers") as u32;
            }
        }
    }
    out
}

/// FNV-1a, 64 bits: a stable hash for cache keys (std's hasher may change between releases).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in part.iter().chain(&[0xffu8]) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// Where compiled kernels are kept: `$SLUICE_CACHE_DIR`, else `~/.cache/sluice/kernels`.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("SLUICE_CACHE_DIR") {
        return Some(PathBuf::from(dir));
    }
    std::env::var_os("HOME").map(|home| Path::new(&home).join(".cache/sluice/kernels"))
}

/// The module's cubin for `arch`, from the cache when a file with the same key (source,
/// architecture, options, driver and NVRTC versions) exists, else compiled and stored. A cache
/// that cannot be read or written only costs a compilation.
pub fn cached_cubin(k: &KernelSource, arch: &str, driver_version: i32) -> Result<Vec<u8>> {
    let source = full_source(k);
    let (major, minor) = nvrtc_version()?;
    let key = fnv1a(&[
        source.as_bytes(),
        arch.as_bytes(),
        options(arch, false).join(" ").as_bytes(),
        &driver_version.to_le_bytes(),
        &major.to_le_bytes(),
        &minor.to_le_bytes(),
    ]);
    let file = cache_dir().map(|d| d.join(format!("{}-{arch}-{key:016x}.cubin", k.name)));
    if let Some(bytes) = file.as_ref().and_then(|f| std::fs::read(f).ok())
        && !bytes.is_empty()
    {
        return Ok(bytes);
    }
    let compiled = compile(k.name, &source, arch, false)?;
    if let Some(file) = file {
        store(&file, &compiled.cubin);
    }
    Ok(compiled.cubin)
}

/// Writes through a temporary file and a rename, so a concurrent reader never sees half a file.
fn store(file: &Path, bytes: &[u8]) {
    let Some(dir) = file.parent() else { return };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let tmp = file.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::write(&tmp, bytes).is_ok() && std::fs::rename(&tmp, file).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptxas_report_is_read_per_function() {
        let log = "\
ptxas info    : Compiling entry function 'add' for 'sm_90'
ptxas info    : Function properties for add
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 16 registers, used 0 barriers, 400 bytes cmem[0]
ptxas info    : Function properties for attention_forward_128
    24 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 26112 bytes smem
";
        let usage = parse_ptxas_report(log);
        assert_eq!(usage.len(), 2);
        assert_eq!(usage[0].function, "add");
        assert_eq!((usage[0].registers, usage[0].spill_store_bytes), (16, 0));
        assert_eq!(usage[1].function, "attention_forward_128");
        assert_eq!(usage[1].registers, 255);
        assert_eq!(
            (usage[1].stack_bytes, usage[1].spill_store_bytes, usage[1].spill_load_bytes),
            (24, 8, 12)
        );
    }

    #[test]
    fn cache_keys_depend_on_every_part() {
        let base = fnv1a(&[b"src", b"sm_90"]);
        assert_ne!(base, fnv1a(&[b"src", b"sm_80"]));
        assert_ne!(base, fnv1a(&[b"sr", b"csm_90"]), "parts are delimited");
        assert_eq!(base, fnv1a(&[b"src", b"sm_90"]));
    }
}
