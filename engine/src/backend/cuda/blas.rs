//! GEMMs through cuBLASLt: bf16 operands, f32 accumulation, a bf16 or f32 output, and an
//! algorithm chosen once per shape (the heuristic's first pick, cached with its descriptors).
//! Groups of GEMMs with bf16 outputs (a mixture-of-experts layer's experts) can instead go to
//! cuBLAS's `cublasGemmGroupedBatchedEx` as one call: see [`Blas::grouped_gemm`].
//! cuBLAS is column-major; the callers state the row-major product they want and how it maps.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::cublas::{result as classic, sys as classic_sys};
use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, CudaStream};

use super::device::{base_ptr, drv, err};
use crate::error::Result;

/// One column-major product `D = op(A) op(B) + beta C (+ bias)`: C is D itself unless
/// [`Blas::gemm_into`] is given another C of the same layout.
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
    /// A bf16 vector of `m` elements added to every column of the product in the epilogue
    /// (`CUBLASLT_EPILOGUE_BIAS`); bf16 D only.
    pub bias: bool,
}

/// The device addresses of one [`Gemm`]'s operands: C is read (when it accumulates) and D
/// written; `bias` is 0 unless the product has one.
#[derive(Debug, Clone, Copy)]
pub(super) struct GemmPtrs {
    pub a: CUdeviceptr,
    pub b: CUdeviceptr,
    pub c: CUdeviceptr,
    pub d: CUdeviceptr,
    pub bias: CUdeviceptr,
}

/// The cached part: what the heuristic needs to see again only for a new shape or alignment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    gemm: Gemm,
    /// Alignment in bytes (power of two, at most 256) of the A, B, C and D pointers.
    align: [u32; 4],
}

struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    algo: sys::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: created in `Blas::plan`, destroyed once here.
        unsafe {
            let _ = lt::destroy_matmul_desc(self.desc);
            for l in self.layouts {
                let _ = lt::destroy_matrix_layout(l);
            }
        }
    }
}

/// A cuBLAS (not cuBLASLt) handle, for `cublasGemmGroupedBatchedEx`.
struct Classic(classic_sys::cublasHandle_t);

/// The cuBLASLt and cuBLAS handles, the workspace they share and the plan cache.
pub(super) struct Blas {
    handle: sys::cublasLtHandle_t,
    classic: Mutex<Classic>,
    workspace: CudaSlice<u8>,
    plans: Mutex<HashMap<Key, Plan>>,
    stream: Arc<CudaStream>,
}

// SAFETY: the cuBLASLt handle and the plans' descriptors are only used while holding the `plans`
// lock, and the cuBLAS handle only while holding its own, so no two threads call either library
// with them at once (cuBLAS asks exactly that of a handle shared between threads).
unsafe impl Send for Blas {}
// SAFETY: as above.
unsafe impl Sync for Blas {}

impl Drop for Blas {
    fn drop(&mut self) {
        if let Ok(mut plans) = self.plans.lock() {
            plans.clear();
        }
        // The handles free their own device memory, in this context, from whatever thread drops
        // the backend.
        let _ = self.stream.context().bind_to_thread();
        // SAFETY: created in `new`, destroyed once, before the workspace they were given is
        // freed (fields drop after this).
        unsafe {
            let _ = lt::destroy_handle(self.handle);
            if let Ok(c) = self.classic.get_mut() {
                let _ = classic::destroy_handle(c.0);
            }
        }
    }
}

fn cublas<T>(what: &str, r: std::result::Result<T, lt::CublasError>) -> Result<T> {
    r.map_err(|e| err(format!("cuBLASLt {what}: {e:?}")))
}

fn cublas_classic<T>(what: &str, r: std::result::Result<T, classic::CublasError>) -> Result<T> {
    r.map_err(|e| err(format!("cuBLAS {what}: {e:?}")))
}

/// Largest power of two dividing `ptr`, capped at 256 bytes.
fn alignment(ptr: CUdeviceptr) -> u32 {
    if ptr == 0 { 256 } else { 1u32 << ptr.trailing_zeros().min(8) }
}

impl Blas {
    /// Workspace: 32 MiB as NVIDIA recommends for Hopper (enough for every earlier GPU too).
    const WORKSPACE: usize = 32 << 20;

    /// Most plans kept; a dense model's step uses a few dozen.
    const MAX_PLANS: usize = 4096;

    /// The first cuBLAS with `cublasGemmGroupedBatchedEx`, 12.5, as `cublasGetVersion` writes it.
    const GROUPED_VERSION: i32 = 12_05_00;

    pub(super) fn new(stream: Arc<CudaStream>) -> Result<Self> {
        // SAFETY: the workspace is scratch that cuBLASLt and cuBLAS write before reading.
        let workspace =
            drv("allocating the cuBLAS workspace", unsafe { stream.alloc::<u8>(Self::WORKSPACE) })?;
        let handle = cublas("create", lt::create_handle())?;
        let classic = match Self::classic(&stream, &workspace) {
            Ok(c) => c,
            Err(e) => {
                // SAFETY: created above and not yet owned by a `Blas`, so destroyed only here.
                let _ = unsafe { lt::destroy_handle(handle) };
                return Err(e);
            }
        };
        Ok(Blas {
            handle,
            classic: Mutex::new(classic),
            workspace,
            plans: Mutex::new(HashMap::new()),
            stream,
        })
    }

    /// The cuBLAS handle: bound to the compute stream, given cuBLASLt's workspace, and set up to
    /// compute as the cuBLASLt GEMMs do and to give the same bits every run.
    fn classic(stream: &Arc<CudaStream>, workspace: &CudaSlice<u8>) -> Result<Classic> {
        drv("binding the CUDA context", stream.context().bind_to_thread())?;
        let c = Classic(cublas_classic("create", classic::create_handle())?);
        let setup = || -> Result<()> {
            // SAFETY: the handle is live and the stream is the backend's compute stream, which
            // outlives it (`Cuda` holds both). Setting the stream resets the workspace, so the
            // workspace comes after it.
            cublas_classic("set stream", unsafe {
                classic::set_stream(c.0, stream.cu_stream() as classic_sys::cudaStream_t)
            })?;
            // The workspace is cuBLASLt's: both libraries run only on the compute stream, so
            // their kernels never overlap and one buffer serves both. It outlives the handle
            // (`Blas::drop`), and it is 256-byte aligned as cuBLAS asks (a pool allocation).
            let ws = base_ptr(workspace, stream);
            // SAFETY: the handle is live; `ws` is a device buffer of `WORKSPACE` bytes.
            cublas_classic("set workspace", unsafe {
                classic_sys::cublasSetWorkspace_v2(c.0, ws as *mut c_void, Self::WORKSPACE).result()
            })?;
            // The default math (the compute type alone decides: bf16 products summed in f32, no
            // TF32 or emulation, as in the cuBLASLt GEMMs), with any split-K partial sums also
            // added in f32 rather than in the bf16 output type.
            // SAFETY: the handle is live; the mode is a valid `cublasMath_t`.
            cublas_classic("set math mode", unsafe {
                classic_sys::cublasSetMathMode(
                    c.0,
                    classic_sys::cublasMath_t::CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION,
                )
                .result()
            })?;
            // No atomics (cuBLAS's default, stated): with one stream and a fixed workspace,
            // cuBLAS then gives the same bits run to run.
            // SAFETY: the handle is live.
            cublas_classic("set atomics mode", unsafe {
                classic_sys::cublasSetAtomicsMode(
                    c.0,
                    classic_sys::cublasAtomicsMode_t::CUBLAS_ATOMICS_NOT_ALLOWED,
                )
                .result()
            })?;
            // alpha and beta are host arrays.
            // SAFETY: the handle is live.
            cublas_classic("set pointer mode", unsafe {
                classic_sys::cublasSetPointerMode_v2(
                    c.0,
                    classic_sys::cublasPointerMode_t::CUBLAS_POINTER_MODE_HOST,
                )
                .result()
            })?;
            let mut version = 0;
            // SAFETY: the handle is live; `version` is valid for writes.
            cublas_classic("version", unsafe {
                classic_sys::cublasGetVersion_v2(c.0, &mut version).result()
            })?;
            // The loader panics on a missing symbol, so an older cuBLAS is refused here.
            if version < Self::GROUPED_VERSION {
                return Err(err(format!(
                    "libcublas {version} is older than 12.5 and lacks cublasGemmGroupedBatchedEx \
                     (install the CUDA 13 toolkit or the nvidia-cublas wheel)"
                )));
            }
            Ok(())
        };
        match setup() {
            Ok(()) => Ok(c),
            Err(e) => {
                // SAFETY: created above and not returned, so destroyed only here.
                let _ = unsafe { classic::destroy_handle(c.0) };
                Err(e)
            }
        }
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
        let mut desc_attrs = vec![
            (
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                i32::from(g.trans_a),
            ),
            (
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                i32::from(g.trans_b),
            ),
        ];
        if g.bias {
            if g.c_f32 {
                return Err(err(format!("cuBLASLt: a bias epilogue into an f32 output in {g:?}")));
            }
            desc_attrs.extend([
                (
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE,
                    sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS as i32,
                ),
                (
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                    bf16 as i32,
                ),
            ]);
        }
        for (attr, value) in desc_attrs {
            // SAFETY: the descriptor is live; each of these attributes is a 32-bit enum
            // (cublasOperation_t, cublasLtEpilogue_t, cudaDataType_t).
            cublas("matmul descriptor attribute", unsafe {
                lt::set_matmul_desc_attribute(
                    plan.desc,
                    attr,
                    (&value as *const i32).cast::<c_void>(),
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
                &align[3],
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
        self.gemm_into(g, GemmPtrs { a, b, c, d: c, bias: 0 })
    }

    /// The alignment a bias must have for the epilogue: 16 bytes, which other users of
    /// cuBLASLt's bias epilogue found it to need. A bias at any other address is added by the
    /// caller's own kernel.
    pub(super) const BIAS_ALIGN: u64 = 16;

    /// Runs `g` with its operands at `p`, on the compute stream. C and D are the same matrix
    /// or two of the same layout (then `g.accumulate` reads C and D is only written); a bias
    /// must be [`Blas::BIAS_ALIGN`]-aligned.
    pub(super) fn gemm_into(&self, g: Gemm, p: GemmPtrs) -> Result<()> {
        if g.m == 0 || g.n == 0 {
            return Ok(());
        }
        if g.k == 0 {
            return Err(err(format!("cuBLASLt: empty inner dimension in {g:?}")));
        }
        if g.bias != (p.bias != 0) || (g.bias && !p.bias.is_multiple_of(Self::BIAS_ALIGN)) {
            return Err(err(format!("cuBLASLt: bias at {:#x} for {g:?}", p.bias)));
        }
        let (a, b, c, d) = (p.a, p.b, p.c, p.d);
        let key = Key { gemm: g, align: [alignment(a), alignment(b), alignment(c), alignment(d)] };
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
        if g.bias {
            // The descriptor belongs to this plan, used only under the cache's lock; the
            // pointer is read when the GEMM is queued.
            // SAFETY: the descriptor is live; the attribute is a device pointer (8 bytes).
            cublas("bias pointer", unsafe {
                lt::set_matmul_desc_attribute(
                    plan.desc,
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    (&p.bias as *const CUdeviceptr).cast::<c_void>(),
                    std::mem::size_of::<CUdeviceptr>(),
                )
            })?;
        }
        let (alpha, beta) = (1.0f32, if g.accumulate { 1.0f32 } else { 0.0 });
        let ws = base_ptr(&self.workspace, &self.stream);
        // SAFETY: the plan describes this product; the pointers are device addresses of buffers
        // whose extents the caller checked against m, n, k and the leading dimensions (D's as
        // C's, and m elements of bias); the scalars are f32 as the f32 compute/scale type
        // requires.
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
                d as *mut c_void,
                plan.layouts[2],
                &plan.algo,
                ws as *mut c_void,
                Self::WORKSPACE,
                self.stream.cu_stream() as sys::cudaStream_t,
            )
        })
    }

    /// Whether [`Blas::grouped_gemm`] computes `g` with A, B and C at `ptrs`.
    ///
    /// Types: `cublasGemmGroupedBatchedEx` takes bf16 A and B with `CUBLAS_COMPUTE_32F` only
    /// into a bf16 C (its documented combinations pair each input type with the same output
    /// type), so a product into an f32 accumulator stays with cuBLASLt.
    ///
    /// Alignment: cuBLAS reads the matrices' addresses from device memory as the kernel runs,
    /// so unlike cuBLASLt here (whose plan key carries each pointer's alignment) it cannot pick
    /// kernels by them, and its batched forms ask f16/bf16 matrices to be suitably aligned,
    /// ideally to 16 bytes. We ask for 16 bytes of every address and every leading dimension,
    /// which widths that are multiples of 8 give in the slabs (tensors start 64 elements
    /// aligned) and in pool allocations (256 bytes); anything else stays with cuBLASLt, which
    /// takes any alignment.
    pub(super) fn groups(g: &Gemm, ptrs: [CUdeviceptr; 3]) -> bool {
        const BF16: u64 = 2;
        let fits = |v: u64| i32::try_from(v).is_ok();
        let ld_ok = |ld: i64| ld > 0 && fits(ld as u64) && (ld as u64 * BF16).is_multiple_of(16);
        !g.c_f32
            && g.m > 0
            && g.n > 0
            && g.k > 0
            && fits(g.m)
            && fits(g.n)
            && fits(g.k)
            && ld_ok(g.lda)
            && ld_ok(g.ldb)
            && ld_ok(g.ldc)
            && ptrs.iter().all(|&p| p.is_multiple_of(16))
    }

    /// Runs every problem, `(gemm, [A, B, C])`, as one `cublasGemmGroupedBatchedEx` on the
    /// compute stream: one group per problem (group size 1), each with its own sizes, leading
    /// dimensions and beta. Every problem must satisfy [`Blas::groups`].
    pub(super) fn grouped_gemm(&self, problems: &[(Gemm, [CUdeviceptr; 3])]) -> Result<()> {
        if problems.is_empty() {
            return Ok(());
        }
        if let Some((g, _)) = problems.iter().find(|(g, p)| !Self::groups(g, *p)) {
            return Err(err(format!("cuBLAS grouped GEMM: cannot run {g:?}")));
        }
        let count = i32::try_from(problems.len())
            .map_err(|_| err(format!("cuBLAS grouped GEMM: {} problems", problems.len())))?;
        let op = |t: bool| {
            if t {
                classic_sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                classic_sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        // Every size was checked to fit an i32 by `groups`.
        let ints = |f: &dyn Fn(&Gemm) -> u64| -> Vec<i32> {
            problems.iter().map(|(g, _)| f(g) as i32).collect()
        };
        let trans_a: Vec<_> = problems.iter().map(|(g, _)| op(g.trans_a)).collect();
        let trans_b: Vec<_> = problems.iter().map(|(g, _)| op(g.trans_b)).collect();
        let (m, n, k) = (ints(&|g| g.m), ints(&|g| g.n), ints(&|g| g.k));
        let (lda, ldb, ldc) =
            (ints(&|g| g.lda as u64), ints(&|g| g.ldb as u64), ints(&|g| g.ldc as u64));
        let alpha = vec![1.0f32; problems.len()];
        let beta: Vec<f32> =
            problems.iter().map(|(g, _)| if g.accumulate { 1.0 } else { 0.0 }).collect();
        let sizes = vec![1i32; problems.len()];
        // The A, B and C pointer arrays, one after another in one device buffer. Copied from
        // pageable memory in stream order, so they are in place before the GEMM reads them;
        // the buffer is freed in stream order too when it drops at the end of this function,
        // after the GEMM is queued, so it lives until the GEMM has run.
        let mut addresses = Vec::with_capacity(3 * problems.len());
        for operand in 0..3 {
            addresses.extend(problems.iter().map(|(_, p)| p[operand]));
        }
        let table = drv("copying the grouped GEMM's pointers", self.stream.clone_htod(&addresses))?;
        let base = base_ptr(&table, &self.stream);
        let array = |operand: u64| base + operand * 8 * problems.len() as u64;
        let bf16 = classic_sys::cudaDataType_t::CUDA_R_16BF;
        let classic = self.classic.lock().map_err(|_| err("cuBLAS handle poisoned"))?;
        // SAFETY: the handle is live, bound to the compute stream, and held alone under its
        // lock. The host arrays each hold `count` entries and outlive the call, which reads them
        // before returning (alpha and beta in host pointer mode). The three pointer arrays are
        // `count` device addresses each in `table` (8-byte aligned: a pool allocation), written
        // by the copy queued before this call on the same stream; each address points at a bf16
        // matrix whose extent the caller checked against that problem's m, n, k and leading
        // dimensions; `groups` checked the types and the alignment.
        cublas_classic("grouped GEMM", unsafe {
            classic_sys::cublasGemmGroupedBatchedEx(
                classic.0,
                trans_a.as_ptr(),
                trans_b.as_ptr(),
                m.as_ptr(),
                n.as_ptr(),
                k.as_ptr(),
                alpha.as_ptr().cast(),
                array(0) as *const *const c_void,
                bf16,
                lda.as_ptr(),
                array(1) as *const *const c_void,
                bf16,
                ldb.as_ptr(),
                beta.as_ptr().cast(),
                array(2) as *const *mut c_void,
                bf16,
                ldc.as_ptr(),
                count,
                sizes.as_ptr(),
                classic_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            )
            .result()
        })
    }
}
