//! GEMMs through cuBLASLt: bf16 operands, f32 accumulation, a bf16 or f32 output, and an
//! algorithm chosen once per shape (the heuristic's first pick, cached with its descriptors).
//! cuBLAS is column-major; the callers state the row-major product they want and how it maps.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, CudaStream};

use super::device::{base_ptr, drv, err};
use crate::error::Result;

/// One column-major product `D = op(A) op(B) + beta C` with `C = D`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Gemm {
    pub trans_a: bool,
    pub trans_b: bool,
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub lda: i64,
    pub ldb: i64,
    pub ldc: i64,
    /// Output precision: f32 (weight-gradient accumulators) or bf16 (activations).
    pub c_f32: bool,
    /// `beta = 1` (accumulate into C) or 0 (overwrite).
    pub accumulate: bool,
}

/// The cached part: what the heuristic needs to see again only for a new shape or alignment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    gemm: Gemm,
    /// Alignment in bytes (power of two, at most 256) of the A, B and C pointers.
    align: [u32; 3],
}

struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    algo: sys::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: created in `Lt::plan`, destroyed once here.
        unsafe {
            let _ = lt::destroy_matmul_desc(self.desc);
            for l in self.layouts {
                let _ = lt::destroy_matrix_layout(l);
            }
        }
    }
}

/// The cuBLASLt handle, its workspace and the plan cache.
pub(super) struct Lt {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    plans: Mutex<HashMap<Key, Plan>>,
    stream: Arc<CudaStream>,
}

// SAFETY: the handle and the plans' descriptors are only used while holding the `plans` lock,
// so no two threads call cuBLASLt with them at once.
unsafe impl Send for Lt {}
// SAFETY: as above.
unsafe impl Sync for Lt {}

impl Drop for Lt {
    fn drop(&mut self) {
        if let Ok(mut plans) = self.plans.lock() {
            plans.clear();
        }
        // SAFETY: created in `new`, destroyed once.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

fn cublas<T>(what: &str, r: std::result::Result<T, lt::CublasError>) -> Result<T> {
    r.map_err(|e| err(format!("cuBLASLt {what}: {e:?}")))
}

/// Largest power of two dividing `ptr`, capped at 256 bytes.
fn alignment(ptr: CUdeviceptr) -> u32 {
    if ptr == 0 { 256 } else { 1u32 << ptr.trailing_zeros().min(8) }
}

impl Lt {
    /// Workspace: 32 MiB as NVIDIA recommends for Hopper (enough for every earlier GPU too).
    const WORKSPACE: usize = 32 << 20;

    /// Most plans kept; a dense model's step uses a few dozen.
    const MAX_PLANS: usize = 4096;

    pub(super) fn new(stream: Arc<CudaStream>) -> Result<Self> {
        let handle = cublas("create", lt::create_handle())?;
        // SAFETY: the workspace is scratch that cuBLASLt writes before reading.
        let workspace = drv("allocating the cuBLASLt workspace", unsafe {
            stream.alloc::<u8>(Self::WORKSPACE)
        })?;
        Ok(Lt { handle, workspace, plans: Mutex::new(HashMap::new()), stream })
    }

    fn plan(&self, key: &Key) -> Result<Plan> {
        let g = key.gemm;
        let desc = cublas(
            "matmul descriptor",
            lt::create_matmul_desc(
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cudaDataType::CUDA_R_32F,
            ),
        )?;
        let bf16 = sys::cudaDataType::CUDA_R_16BF;
        let c_type = if g.c_f32 { sys::cudaDataType::CUDA_R_32F } else { bf16 };
        // Stored shapes: op(A) is m x k, so A is stored k x m when transposed, and so on.
        let (a_rows, a_cols) = if g.trans_a { (g.k, g.m) } else { (g.m, g.k) };
        let (b_rows, b_cols) = if g.trans_b { (g.n, g.k) } else { (g.k, g.n) };
        let mut plan = Plan {
            desc,
            layouts: [std::ptr::null_mut(); 3],
            algo: sys::cublasLtMatmulAlgo_t { data: [0; 8] },
        };
        plan.layouts[0] =
            cublas("layout A", lt::create_matrix_layout(bf16, a_rows, a_cols, g.lda))?;
        plan.layouts[1] =
            cublas("layout B", lt::create_matrix_layout(bf16, b_rows, b_cols, g.ldb))?;
        plan.layouts[2] = cublas("layout C", lt::create_matrix_layout(c_type, g.m, g.n, g.ldc))?;
        for (attr, t) in [
            (sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA, g.trans_a),
            (sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB, g.trans_b),
        ] {
            let op = i32::from(t);
            // SAFETY: the descriptor is live; the attribute is a 32-bit cublasOperation_t.
            cublas("transpose attribute", unsafe {
                lt::set_matmul_desc_attribute(
                    plan.desc,
                    attr,
                    (&op as *const i32).cast::<c_void>(),
                    std::mem::size_of::<i32>(),
                )
            })?;
        }
        let pref = cublas("preference", lt::create_matmul_pref())?;
        // MAX_WORKSPACE_BYTES is a uint64_t, the MIN_ALIGNMENT ones uint32_t.
        let ws = (Self::WORKSPACE as u64).to_le_bytes();
        let align = key.align.map(u32::to_le_bytes);
        let attrs: [(sys::cublasLtMatmulPreferenceAttributes_t, &[u8]); 5] = [
            (sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws),
            (
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                &align[0],
            ),
            (
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                &align[1],
            ),
            (
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                &align[2],
            ),
            (
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                &align[2],
            ),
        ];
        let mut result = Ok(());
        for (attr, value) in attrs {
            if result.is_ok() {
                // SAFETY: the preference is live; `value` holds the attribute's native-endian
                // integer of the size cuBLASLt expects for it.
                result = cublas("preference attribute", unsafe {
                    lt::set_matmul_pref_attribute(
                        pref,
                        attr,
                        value.as_ptr().cast::<c_void>(),
                        value.len(),
                    )
                });
            }
        }
        let heuristic = result.and_then(|()| {
            // SAFETY: every descriptor is live and describes this product.
            cublas(&format!("no algorithm for {g:?}"), unsafe {
                lt::get_matmul_algo_heuristic(
                    self.handle,
                    plan.desc,
                    plan.layouts[0],
                    plan.layouts[1],
                    plan.layouts[2],
                    plan.layouts[2],
                    pref,
                )
            })
        });
        // SAFETY: created above, destroyed once.
        let _ = unsafe { lt::destroy_matmul_pref(pref) };
        plan.algo = heuristic?.algo;
        Ok(plan)
    }

    /// Runs `g` with A at `a`, B at `b` and C = D at `c`, on the compute stream.
    pub(super) fn gemm(
        &self,
        g: Gemm,
        a: CUdeviceptr,
        b: CUdeviceptr,
        c: CUdeviceptr,
    ) -> Result<()> {
        if g.m == 0 || g.n == 0 {
            return Ok(());
        }
        if g.k == 0 {
            return Err(err(format!("cuBLASLt: empty inner dimension in {g:?}")));
        }
        let key = Key { gemm: g, align: [alignment(a), alignment(b), alignment(c)] };
        let mut plans = self.plans.lock().map_err(|_| err("cuBLASLt plan cache poisoned"))?;
        if plans.len() >= Self::MAX_PLANS && !plans.contains_key(&key) {
            // The experts' GEMMs of a mixture-of-experts layer see new row counts every step,
            // so the cache would grow without end. Starting over costs only heuristic queries,
            // and the algorithm is a function of the key: results do not depend on what the
            // cache held.
            plans.clear();
        }
        let plan = match plans.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(self.plan(&key)?),
        };
        let (alpha, beta) = (1.0f32, if g.accumulate { 1.0f32 } else { 0.0 });
        let ws = base_ptr(&self.workspace, &self.stream);
        // SAFETY: the plan describes this product; the pointers are device addresses of buffers
        // whose extents the caller checked against m, n, k and the leading dimensions; the
        // scalars are f32 as the f32 compute/scale type requires.
        cublas("matmul", unsafe {
            lt::matmul(
                self.handle,
                plan.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                a as *const c_void,
                plan.layouts[0],
                b as *const c_void,
                plan.layouts[1],
                c as *const c_void,
                plan.layouts[2],
                c as *mut c_void,
                plan.layouts[2],
                &plan.algo,
                ws as *mut c_void,
                Self::WORKSPACE,
                self.stream.cu_stream() as sys::cudaStream_t,
            )
        })
    }
}
