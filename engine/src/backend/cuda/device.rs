//! The device layer: finding the driver, the GPU and the libraries (each absence is an `Err`
//! that says which, never a panic), the context and its streams, the memory pool, pinned host
//! memory, kernel loading and launching, and raw pointers into device buffers.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys::{self as cu, CUdeviceptr};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig,
    result as driver,
};

use super::compile;
use super::kernel::Kernel;
use crate::error::{Error, Result};

pub(super) fn err(message: impl std::fmt::Display) -> Error {
    Error::Backend { backend: "cuda".into(), message: message.to_string() }
}

/// Turns a driver error into the backend's error, naming what was being done.
pub(super) fn drv<T>(what: &str, r: std::result::Result<T, driver::DriverError>) -> Result<T> {
    r.map_err(|e| err(format!("{what}: {e}")))
}

/// Checks, in order, that the driver, a GPU and the libraries the backend loads are present,
/// and returns the number of GPUs.
pub fn probe() -> Result<usize> {
    // SAFETY: only tries to dlopen libcuda under its usual names.
    if !unsafe { cu::is_culib_present() } {
        return Err(err("no NVIDIA driver: libcuda.so could not be loaded"));
    }
    let count = match CudaContext::device_count() {
        Ok(n) => usize::try_from(n).unwrap_or(0),
        Err(e) if e.0 == cu::CUresult::CUDA_ERROR_NO_DEVICE => 0,
        Err(e) => return Err(err(format!("the NVIDIA driver failed to start: {e}"))),
    };
    if count == 0 {
        return Err(err("no GPU: the NVIDIA driver is loaded but sees no device"));
    }
    // SAFETY: only tries to dlopen libcublasLt under its usual names.
    if !unsafe { cudarc::cublaslt::sys::is_culib_present() } {
        return Err(err(
            "libcublasLt not found (install the CUDA 13 toolkit or the nvidia-cublas wheel and \
             put its lib directory on LD_LIBRARY_PATH)",
        ));
    }
    // SAFETY: only tries to dlopen libcublas under its usual names.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err(err(
            "libcublas not found (install the CUDA 13 toolkit or the nvidia-cublas wheel and \
             put its lib directory on LD_LIBRARY_PATH)",
        ));
    }
    compile::nvrtc_present()?;
    Ok(count)
}

/// Free and total memory of GPU `ordinal` in bytes, as the driver reports them
/// (`cuMemGetInfo`). Needs only the driver, not the libraries the backend loads, so a planner can
/// ask before anything is built; the reading is taken inside the device's primary context, the
/// one a training run then shares, so that context's own reservation is already deducted from
/// `free`.
pub fn device_memory(ordinal: usize) -> Result<(u64, u64)> {
    // SAFETY: only tries to dlopen libcuda under its usual names.
    if !unsafe { cu::is_culib_present() } {
        return Err(err("no NVIDIA driver: libcuda.so could not be loaded"));
    }
    let count = match CudaContext::device_count() {
        Ok(n) => usize::try_from(n).unwrap_or(0),
        Err(e) if e.0 == cu::CUresult::CUDA_ERROR_NO_DEVICE => 0,
        Err(e) => return Err(err(format!("the NVIDIA driver failed to start: {e}"))),
    };
    if ordinal >= count {
        return Err(err(format!("no GPU {ordinal}: the driver sees {count}")));
    }
    let ctx = drv("creating the CUDA context", CudaContext::new(ordinal))?;
    let (free, total) = drv("cuMemGetInfo", ctx.mem_get_info())?;
    Ok((free as u64, total as u64))
}

impl super::Cuda {
    /// Free and total memory of this backend's GPU right now, in bytes (`cuMemGetInfo`).
    pub fn memory(&self) -> Result<(u64, u64)> {
        let (free, total) = drv("cuMemGetInfo", self.ctx.mem_get_info())?;
        Ok((free as u64, total as u64))
    }
}

/// The CUDA driver's version, e.g. 13000 for CUDA 13.0.
pub(super) fn driver_version() -> Result<i32> {
    let mut v = 0;
    // SAFETY: the driver is loaded (checked by `probe`); `v` is valid for writes.
    drv("cuDriverGetVersion", unsafe { cu::cuDriverGetVersion(&mut v) }.result())?;
    Ok(v)
}

/// Keeps freed device memory in the context's default pool instead of returning it to the OS at
/// every synchronisation, so per-op scratch allocations are cheap.
pub(super) fn raise_pool_threshold(ctx: &CudaContext) -> Result<()> {
    if !ctx.has_async_alloc() {
        return Ok(());
    }
    let mut pool: cu::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: the context's device is valid; `pool` is valid for writes.
    drv("cuDeviceGetDefaultMemPool", unsafe {
        cu::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()).result()
    })?;
    let mut threshold = u64::MAX;
    // SAFETY: `pool` was just obtained; the attribute takes a u64 by pointer.
    drv("cuMemPoolSetAttribute", unsafe {
        cu::cuMemPoolSetAttribute(
            pool,
            cu::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast::<c_void>(),
        )
        .result()
    })
}

/// Page-locked host memory that the CPU reads and writes at full speed: allocated PORTABLE,
/// never write-combined (write-combined memory is uncached for CPU reads).
#[derive(Debug)]
pub struct PinnedBuffer {
    ptr: *mut u8,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the buffer is plain host memory owned by this value; access goes through `&`/`&mut`.
unsafe impl Send for PinnedBuffer {}
// SAFETY: as above; shared references only read.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    pub(super) fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        drv("binding the context", ctx.bind_to_thread())?;
        let ptr = if bytes == 0 {
            std::ptr::null_mut()
        } else {
            // SAFETY: a plain allocation of `bytes` bytes; freed in Drop.
            drv("pinned host allocation", unsafe {
                driver::malloc_host(bytes, cu::CU_MEMHOSTALLOC_PORTABLE)
            })?
            .cast::<u8>()
        };
        Ok(PinnedBuffer { ptr, bytes, ctx: ctx.clone() })
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The first `len` elements of the buffer as `T`.
    pub(super) fn slice_mut<T: DeviceRepr>(&mut self, len: usize) -> Result<&mut [T]> {
        let need = len.checked_mul(std::mem::size_of::<T>()).ok_or_else(|| err("size overflow"))?;
        if need > self.bytes || (need > 0 && !self.ptr.cast::<T>().is_aligned()) {
            return Err(err(format!("pinned buffer of {} bytes cannot hold {need}", self.bytes)));
        }
        if len == 0 {
            return Ok(&mut []);
        }
        // SAFETY: the memory is ours, large enough and aligned (checked); pinned memory from
        // cuMemHostAlloc is page-aligned. Every `DeviceRepr` type used here (u16, f32, i32) is
        // valid for any bit pattern.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr.cast::<T>(), len) })
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            let _ = self.ctx.bind_to_thread();
            // SAFETY: allocated by cuMemHostAlloc in `new`, freed once.
            let _ = unsafe { driver::free_host(self.ptr.cast()) };
        }
    }
}

/// Every kernel, compiled for the device's own architecture and loaded.
pub(super) struct Kernels {
    functions: HashMap<&'static str, CudaFunction>,
}

impl Kernels {
    pub(super) fn load(ctx: &Arc<CudaContext>, arch: &str, driver: i32) -> Result<Self> {
        let mut functions = HashMap::new();
        for k in compile::SOURCES {
            let cubin = compile::cached_cubin(k, arch, driver)?;
            let module = drv(
                &format!("loading kernel module {}", k.name),
                ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin)),
            )?;
            for &name in k.entry_points {
                let f = drv(&format!("loading kernel {name}"), module.load_function(name))?;
                functions.insert(name, f);
            }
        }
        Ok(Kernels { functions })
    }

    pub(super) fn get(&self, name: &str) -> Result<&CudaFunction> {
        self.functions.get(name).ok_or_else(|| err(format!("no kernel named {name}")))
    }
}

/// Dynamic shared memory a block gets without opting in.
const DEFAULT_DYNAMIC_SHARED: u32 = 48 * 1024;

/// Launches `f` on `stream` with `args`, whose fields are the kernel's parameters in order and
/// type (pointers as 64-bit device addresses): `kernel.rs` declares them and checks them against
/// the CUDA C signatures.
pub(super) fn launch<K: Kernel>(
    stream: &CudaStream,
    f: &CudaFunction,
    name: &str,
    cfg: LaunchConfig,
    args: &K,
) -> Result<()> {
    if cfg.grid_dim.0 == 0 || cfg.grid_dim.1 == 0 || cfg.grid_dim.2 == 0 {
        return Ok(());
    }
    if cfg.shared_mem_bytes > DEFAULT_DYNAMIC_SHARED {
        // Above 48 KiB a kernel must opt in; the driver refuses sizes the device cannot give.
        drv(
            &format!("{name}: allowing {} bytes of dynamic shared memory", cfg.shared_mem_bytes),
            f.set_attribute(
                cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                cfg.shared_mem_bytes as i32,
            ),
        )?;
    }
    let mut b = stream.launch_builder(f);
    args.push(&mut b);
    // SAFETY: `args` holds the kernel's parameters in order with matching types (its declaration
    // is checked against the kernel's signature), device addresses of live buffers whose extents
    // the caller checked against the sizes passed.
    drv(&format!("launching {name}"), unsafe { b.launch(cfg) }.map(|_| ()))
}

/// A 1-D grid-stride launch over `n` elements, 256 threads per block.
pub(super) fn grid_1d(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(0, 1 << 20) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

/// The device address of a slice's first element.
pub(super) fn base_ptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> CUdeviceptr {
    // Event tracking is off for this context, so the guard records nothing.
    let (ptr, _guard) = s.device_ptr(stream);
    ptr
}

/// A fresh device buffer from the stream-ordered pool; contents undefined until written.
pub(super) fn scratch<T: DeviceRepr>(stream: &Arc<CudaStream>, len: usize) -> Result<CudaSlice<T>> {
    // SAFETY: callers write every element they later read.
    drv("allocating scratch", unsafe { stream.alloc::<T>(len.max(1)) })
}
