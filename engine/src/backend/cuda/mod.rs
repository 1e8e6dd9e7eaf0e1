//! The CUDA backend: the CPU reference's ops on an NVIDIA GPU (sm_80 and newer), with bf16
//! storage for activations and weights, f32 for gradient accumulators, and f32 math everywhere.
//!
//! Built on cudarc with dynamic loading, so the binary links no CUDA library: it builds and
//! starts on machines without CUDA, and [`Cuda::new`] answers an `Err` that says what is missing
//! (no NVIDIA driver, no GPU, no libcublasLt or libcublas, no libnvrtc). Kernels are CUDA C
//! compiled by NVRTC for the device's own architecture at start and cached on disk (`compile`);
//! GEMMs go through cuBLASLt, and the experts' grouped GEMMs through cuBLAS where it takes them
//! (`blas`).
//!
//! Layout: [`Device`] is implemented here (memory in `memory`, transfers and events in
//! `transfer`); each op family's trait is implemented in its own file (`elementwise`, `matmul`,
//! `norm`, `attention` with `decode`, `moe`, `loss`), each op opening its profiling scope
//! (`profile`) as its first statement. Every kernel's parameters are declared once in `kernel`,
//! and launches build them by name.
//!
//! Streams: every op here runs on the backend's `compute` stream; the schedule creates its own
//! transfer streams and events and orders them against `compute` (cudarc's per-buffer event
//! tracking is off). `upload_on`/`download_on` are asynchronous on the stream they are given;
//! `upload` and `download` are synchronous. Ops that need scratch take it from the
//! stream-ordered memory pool, whose release threshold is raised so that costs no system call.
//!
//! Determinism: every reduction runs in a fixed order (no float atomics), cuBLASLt uses one
//! algorithm per shape, and cuBLAS runs without atomics on one stream with a fixed workspace, so
//! two identical runs give identical bits.

mod attention;
mod blas;
mod check;
pub mod compile;
mod decode;
mod device;
mod elementwise;
mod kernel;
mod loss;
mod matmul;
mod memory;
mod moe;
pub mod nccl;
mod norm;
mod profile;
mod transfer;

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};

pub use device::{PinnedBuffer, device_memory, probe};
pub use profile::{Gap, OpClass, OpProfile, OpTime};

use super::{Device, FloatKind, WeightDtype};
use crate::error::Result;
use crate::store::HostSlab;
use device::{Kernels, drv, err};

/// A float buffer in device memory, in the precision its [`FloatKind`] chose.
pub enum Floats {
    /// Activations and weights: bf16 bit patterns.
    Bf16(CudaSlice<u16>),
    /// Gradient accumulators and small tables.
    F32(CudaSlice<f32>),
}

impl Floats {
    pub fn len(&self) -> usize {
        match self {
            Floats::Bf16(s) => s.len(),
            Floats::F32(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn kind(&self) -> FloatKind {
        match self {
            Floats::Bf16(_) => FloatKind::Activation,
            Floats::F32(_) => FloatKind::Accum,
        }
    }

    fn elem_bytes(&self) -> usize {
        match self {
            Floats::Bf16(_) => 2,
            Floats::F32(_) => 4,
        }
    }

    fn base(&self, stream: &CudaStream) -> CUdeviceptr {
        match self {
            Floats::Bf16(s) => device::base_ptr(s, stream),
            Floats::F32(s) => device::base_ptr(s, stream),
        }
    }
}

/// An `i32` buffer in device memory and a host copy of what was uploaded, so ops check ids,
/// targets and document bounds without reading the device. The ops that write ints on the
/// device (`moe_route`, `moe_sort`) leave the host copy as it was: ops reading those buffers
/// check their length only, and their kernels bound every index they read.
pub struct Ints {
    dev: CudaSlice<i32>,
    host: Vec<i32>,
}

/// A read-only window `start..start + len` of a float buffer.
#[derive(Clone, Copy)]
pub struct View<'a> {
    buf: &'a Floats,
    start: usize,
    len: usize,
}

/// A writable window of a float buffer.
pub struct ViewMut<'a> {
    buf: &'a mut Floats,
    start: usize,
    len: usize,
}

impl View<'_> {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn kind(&self) -> FloatKind {
        self.buf.kind()
    }
    fn is_f32(&self) -> i32 {
        i32::from(self.kind() == FloatKind::Accum)
    }
}

impl<'a> ViewMut<'a> {
    fn as_view(&self) -> View<'_> {
        View { buf: self.buf, start: self.start, len: self.len }
    }

    /// The same window, borrowed for one op of several that write it in turn.
    fn reborrow(&mut self) -> ViewMut<'_> {
        ViewMut { buf: self.buf, start: self.start, len: self.len }
    }
}

/// An NVIDIA GPU.
pub struct Cuda {
    ctx: Arc<CudaContext>,
    /// Every op of this backend.
    pub compute: Arc<CudaStream>,
    kernels: Kernels,
    blas: blas::Blas,
    name: String,
    arch: String,
    /// Pinned staging for the synchronous `upload`/`download`, grown on demand.
    staging: Mutex<PinnedBuffer>,
    /// Most logits the chunked cross-entropy holds at once (see `loss`).
    loss_chunk_logits: AtomicUsize,
    /// Whether a MoE layer's aligned grouped GEMMs run as one cuBLAS call (see
    /// [`Cuda::set_grouped_gemm`]).
    grouped_gemm: AtomicBool,
    /// Whether `attention_backward` takes the fused tensor-core kernel where it can (see
    /// [`Cuda::set_fused_attention_backward`]).
    fused_attention_backward: AtomicBool,
    /// Whether the attention forward takes the Hopper kernels where they run (see
    /// [`Cuda::set_hopper_attention_forward`]).
    hopper_attention_forward: AtomicBool,
    /// Whether the attention backward takes the Hopper kernels where they run (see
    /// [`Cuda::set_hopper_attention_backward`]).
    hopper_attention_backward: AtomicBool,
    /// Most dynamic shared memory a block may opt into on this device, in bytes.
    shared_optin: usize,
    /// Device time per op, when `sluice bench train --profile` asks (see `profile`).
    profiler: profile::Profiler,
}

impl std::fmt::Debug for Cuda {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cuda").field("name", &self.name).field("arch", &self.arch).finish()
    }
}

impl Cuda {
    /// Opens GPU `ordinal`: checks the driver, the device and the libraries, creates the context
    /// and the compute stream, and loads every kernel (compiled for this GPU, or from the cache).
    pub fn new(ordinal: usize) -> Result<Cuda> {
        let count = probe()?;
        if ordinal >= count {
            return Err(err(format!("no GPU {ordinal}: the driver sees {count}")));
        }
        let ctx = drv("creating the CUDA context", CudaContext::new(ordinal))?;
        // SAFETY: called before any buffer exists; the schedule orders streams with its own
        // events, and every op here runs on the one compute stream.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = drv("compute capability", ctx.compute_capability())?;
        let gpu = drv("device name", ctx.name())?;
        if major < 8 {
            return Err(err(format!(
                "{gpu} has compute capability {major}.{minor}; Sluice needs 8.0 (Ampere) or newer \
                 for bf16"
            )));
        }
        device::raise_pool_threshold(&ctx)?;
        let compute = drv("creating the compute stream", ctx.new_stream())?;
        let arch = format!("sm_{major}{minor}");
        let shared_optin = drv(
            "shared memory per block",
            ctx.attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            ),
        )?;
        let kernels = Kernels::load(&ctx, &arch, device::driver_version()?)?;
        let blas = blas::Blas::new(compute.clone())?;
        let staging = Mutex::new(PinnedBuffer::new(&ctx, 0)?);
        Ok(Cuda {
            name: format!("cuda:{ordinal} {gpu}"),
            arch,
            ctx,
            compute,
            kernels,
            blas,
            staging,
            loss_chunk_logits: AtomicUsize::new(loss::LOGITS_BUDGET),
            grouped_gemm: AtomicBool::new(
                std::env::var("SLUICE_GROUPED_GEMM").is_ok_and(|v| v == "on"),
            ),
            fused_attention_backward: AtomicBool::new(
                std::env::var("SLUICE_ATTENTION_BACKWARD").is_ok_and(|v| v == "fused"),
            ),
            // The Hopper kernels are the default where they run (sm_90); `mma` and
            // `split` / `fused` choose the mma.sync kernels instead, to compare.
            hopper_attention_forward: AtomicBool::new(
                std::env::var("SLUICE_ATTENTION_FORWARD").map_or(true, |v| v != "mma"),
            ),
            hopper_attention_backward: AtomicBool::new(
                std::env::var("SLUICE_ATTENTION_BACKWARD")
                    .map_or(true, |v| v != "split" && v != "fused"),
            ),
            shared_optin: usize::try_from(shared_optin).unwrap_or(0),
            profiler: profile::Profiler::default(),
        })
    }

    /// Runs `attention_backward` on one tensor-core kernel for dq, dk and dv
    /// (`flash_backward_fused_*`: five products per tile instead of the dq and dk/dv kernels'
    /// seven, deterministic through ordered f32 sums) where the head size has one (64, 128) and
    /// the device gives a block the shared memory it needs (sm_80 and sm_90; 128 KiB at head
    /// size 128). Off by default (`SLUICE_ATTENTION_BACKWARD=fused` turns it on): on the H100
    /// (2026-12-06, `sluice bench attention`, Qwen2.5-7B's heads) it took 1.10 of the split
    /// kernels' time at rows of 32,768 tokens, 1.32 at 1,024 and 2.2 at 256. Results differ
    /// from the split kernels' in f32 rounding only.
    pub fn set_fused_attention_backward(&self, on: bool) {
        self.fused_attention_backward.store(on, Ordering::Relaxed);
    }

    /// Whether [`Cuda::set_fused_attention_backward`] is on.
    pub fn fused_attention_backward(&self) -> bool {
        self.fused_attention_backward.load(Ordering::Relaxed)
    }

    /// Runs `attention_forward` on Hopper's warpgroup MMAs (`hopper_forward_*`, sm_90a: the
    /// tensor cores read Q, K and V from shared memory, two warpgroups of 64 queries a block)
    /// where the device is sm_90 and the head size has them (64, 128). On by default
    /// (`SLUICE_ATTENTION_FORWARD=mma` turns it off): on the H100 (2026-12-06, `sluice bench
    /// attention`, Qwen2.5-7B's heads) it took 0.60 of the mma.sync kernel's time at rows of
    /// 32,768 tokens, 0.72 at 1,024 and 0.94 at 256. Results differ from the mma.sync kernels'
    /// in f32 rounding only.
    pub fn set_hopper_attention_forward(&self, on: bool) {
        self.hopper_attention_forward.store(on, Ordering::Relaxed);
    }

    /// Whether [`Cuda::set_hopper_attention_forward`] is on.
    pub fn hopper_attention_forward(&self) -> bool {
        self.hopper_attention_forward.load(Ordering::Relaxed)
    }

    /// Runs `attention_backward` on Hopper's warpgroup MMAs (`hopper_backward_dq_*` and
    /// `hopper_backward_dkv_*`, sm_90a: the split kernels' seven products, operands read by the
    /// tensor cores from shared memory) where the device is sm_90 and the head size has them
    /// (64, 128); it takes precedence over [`Cuda::set_fused_attention_backward`]. On by
    /// default (`SLUICE_ATTENTION_BACKWARD=split` or `fused` turns it off): on the H100
    /// (2026-12-06, as the forward) it took 0.62 of the split kernels' time at rows of 32,768
    /// tokens, 0.70 at 1,024 and 0.80 at 256. Results differ from the mma.sync kernels' in f32
    /// rounding only (at rows where both start their key tiles at the same token, none).
    pub fn set_hopper_attention_backward(&self, on: bool) {
        self.hopper_attention_backward.store(on, Ordering::Relaxed);
    }

    /// Whether [`Cuda::set_hopper_attention_backward`] is on.
    pub fn hopper_attention_backward(&self) -> bool {
        self.hopper_attention_backward.load(Ordering::Relaxed)
    }

    /// Runs a MoE layer's grouped GEMMs (forward and input gradients, bf16 out) as one
    /// `cublasGemmGroupedBatchedEx` call instead of one cuBLASLt GEMM per expert. Off by
    /// default (`SLUICE_GROUPED_GEMM=on` turns it on): on the H200 (2026-12-03, gpt-oss-20b
    /// with 6 layers, 8 x 8 x 1024 tokens per step, about 1024 rows per expert) the grouped
    /// call made the backward 28% slower (1.27 s against 0.99 s) and the step 6% slower, the
    /// same bits either way.
    pub fn set_grouped_gemm(&self, on: bool) {
        self.grouped_gemm.store(on, Ordering::Relaxed);
    }

    /// Caps the logits the chunked cross-entropy materialises at once (default
    /// `placement::LOSS_CHUNK_LOGITS`, 1 GiB of f32): the chunk is `max(1, n / vocab)` tokens. Results do not depend on it beyond
    /// rounding of the weight gradient's sum over chunks.
    pub fn set_loss_chunk_logits(&self, n: usize) {
        self.loss_chunk_logits.store(n.max(1), Ordering::Relaxed);
    }

    fn loss_chunk_tokens(&self, tokens: usize, vocab: usize) -> usize {
        let budget = self.loss_chunk_logits.load(Ordering::Relaxed);
        (budget / vocab.max(1)).clamp(1, tokens.max(1))
    }

    /// The architecture the kernels were compiled for, e.g. `sm_90`.
    pub fn arch(&self) -> &str {
        &self.arch
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Page-locked host memory for the host store: PORTABLE, not write-combined.
    pub fn alloc_pinned(&self, bytes: usize) -> Result<PinnedBuffer> {
        PinnedBuffer::new(&self.ctx, bytes)
    }

    /// Waits for every op issued so far.
    pub fn synchronize(&self) -> Result<()> {
        drv("synchronizing the compute stream", self.compute.synchronize())
    }

    /// The device address of a view's first element.
    fn ptr(&self, v: &View<'_>) -> CUdeviceptr {
        v.buf.base(&self.compute) + (v.start * v.buf.elem_bytes()) as u64
    }

    fn ptr_mut(&self, v: &ViewMut<'_>) -> CUdeviceptr {
        self.ptr(&v.as_view())
    }

    fn ints_ptr(&self, i: &Ints) -> CUdeviceptr {
        device::base_ptr(&i.dev, &self.compute)
    }

    fn bind(&self) -> Result<()> {
        drv("binding the CUDA context", self.ctx.bind_to_thread())
    }

    /// Launches the kernel `args` declares (one entry point) on the compute stream.
    fn launch<K: kernel::Kernel>(&self, cfg: cudarc::driver::LaunchConfig, args: K) -> Result<()> {
        match K::NAMES {
            [name] if !name.ends_with('*') => self.launch_as(name, cfg, args),
            _ => Err(err(format!("{:?} name several kernels: launch one by name", K::NAMES))),
        }
    }

    /// Launches entry point `name`, one of those `args`'s declaration serves, on the compute
    /// stream.
    fn launch_as<K: kernel::Kernel>(
        &self,
        name: &str,
        cfg: cudarc::driver::LaunchConfig,
        args: K,
    ) -> Result<()> {
        if !kernel::serves(K::NAMES, name) {
            return Err(err(format!("kernel {name} is not one of {:?}", K::NAMES)));
        }
        self.bind()?;
        device::launch(&self.compute, self.kernels.get(name)?, name, cfg, &args)
    }
}

fn clamp_range(range: Range<usize>, len: usize) -> (usize, usize) {
    if range.start <= range.end && range.end <= len {
        (range.start, range.end - range.start)
    } else {
        (0, 0)
    }
}

impl Device for Cuda {
    type Floats = Floats;
    type Ints = Ints;
    type View<'a> = View<'a>;
    // The schedule's transfer streams and the events that order them against `compute`
    // (`transfer`).
    type Stream = Arc<CudaStream>;
    type Event = transfer::Event;
    type Mark = cudarc::driver::CudaEvent;
    type ViewMut<'a> = ViewMut<'a>;

    fn weight_dtype(&self) -> WeightDtype {
        WeightDtype::Bf16
    }

    fn pin(&self, slab: &mut HostSlab) -> Result<()> {
        self.pin_slab(slab)
    }

    fn new_stream(&self) -> Result<Arc<CudaStream>> {
        drv("creating a stream", self.ctx.new_stream())
    }

    fn new_event(&self) -> Result<transfer::Event> {
        transfer::Event::new(&self.ctx)
    }

    fn compute_stream(&self) -> Arc<CudaStream> {
        self.compute.clone()
    }

    fn record(&self, event: &transfer::Event, stream: &Arc<CudaStream>) -> Result<()> {
        event.record(stream)
    }

    fn wait(&self, stream: &Arc<CudaStream>, event: &transfer::Event) -> Result<()> {
        event.wait_on(stream)
    }

    fn synchronize(&self, event: &transfer::Event) -> Result<()> {
        event.synchronize()
    }

    fn mark(&self, stream: &Arc<CudaStream>) -> Result<cudarc::driver::CudaEvent> {
        self.bind()?;
        // A timing event, as the op profiler records them (`profile.rs`).
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mark = drv("creating a timing event", self.ctx.new_event(flags))?;
        drv("recording a timing event", mark.record(stream))?;
        Ok(mark)
    }

    fn elapsed(
        &self,
        a: &cudarc::driver::CudaEvent,
        b: &cudarc::driver::CudaEvent,
    ) -> Result<Option<std::time::Duration>> {
        self.bind()?;
        drv("waiting for a timing event", b.synchronize())?;
        let ms = drv("reading two timing events", a.elapsed_ms(b))?;
        // Events on one stream complete in order; a negative reading is timer noise.
        Ok(Some(std::time::Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3)))
    }

    unsafe fn upload_on(
        &self,
        stream: &Arc<CudaStream>,
        dst: ViewMut<'_>,
        src: &HostSlab,
        offset: usize,
    ) -> Result<()> {
        // SAFETY: the caller keeps `src` and `dst` alive and `src` unchanged until the copy
        // has completed (this function's contract).
        unsafe { self.upload_slab(stream, dst, src, offset) }
    }

    unsafe fn upload_f32_on(
        &self,
        stream: &Arc<CudaStream>,
        dst: ViewMut<'_>,
        src: &HostSlab,
        offset: usize,
        staging: Option<&mut Floats>,
    ) -> Result<()> {
        // SAFETY: the caller keeps `src`, `dst` and `staging` as this function's contract
        // asks until the copy and the cast have completed.
        unsafe { self.upload_cast_slab(stream, dst, src, offset, staging) }
    }

    unsafe fn download_on(
        &self,
        stream: &Arc<CudaStream>,
        dst: &mut HostSlab,
        offset: usize,
        src: View<'_>,
    ) -> Result<()> {
        // SAFETY: as above, for the destination slab.
        unsafe { self.download_slab(stream, dst, offset, src) }
    }

    fn name(&self) -> String {
        self.name.clone()
    }

    fn alloc(&self, len: usize, kind: FloatKind) -> Result<Floats> {
        self.bind()?;
        let what = format!("allocating {len} floats on {}", self.name);
        Ok(match kind {
            FloatKind::Activation => Floats::Bf16(drv(&what, self.compute.alloc_zeros(len))?),
            FloatKind::Accum => Floats::F32(drv(&what, self.compute.alloc_zeros(len))?),
        })
    }

    fn alloc_ints(&self, len: usize) -> Result<Ints> {
        self.bind()?;
        let dev = drv(&format!("allocating {len} ints"), self.compute.alloc_zeros(len))?;
        Ok(Ints { dev, host: vec![0; len] })
    }

    fn len(&self, buf: &Floats) -> usize {
        buf.len()
    }

    /// A range outside the buffer gives an empty view (the trait's `view` cannot fail), which the
    /// next op using it rejects for its length.
    fn view<'a>(&self, buf: &'a Floats, range: Range<usize>) -> View<'a> {
        let (start, len) = clamp_range(range, buf.len());
        View { buf, start, len }
    }

    /// As [`Cuda::view`].
    fn view_mut<'a>(&self, buf: &'a mut Floats, range: Range<usize>) -> ViewMut<'a> {
        let (start, len) = clamp_range(range, buf.len());
        ViewMut { buf, start, len }
    }

    fn upload(&self, dst: ViewMut<'_>, src: &[f32]) -> Result<()> {
        self.upload_floats(dst, src)
    }

    fn download(&self, dst: &mut [f32], src: View<'_>) -> Result<()> {
        self.download_floats(dst, src)
    }

    fn upload_ints(&self, dst: &mut Ints, src: &[i32]) -> Result<()> {
        self.upload_int_values(dst, src)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a GPU (CI), opening one is an error that says what is missing, not a panic.
    #[test]
    fn opening_a_gpu_fails_clearly_or_succeeds() {
        match Cuda::new(0) {
            Ok(gpu) => assert!(gpu.name().starts_with("cuda:0 ")),
            Err(e) => {
                let m = e.to_string();
                let known =
                    ["no NVIDIA driver", "no GPU", "libcublasLt not found", "libnvrtc not found"];
                assert!(known.iter().any(|k| m.contains(k)), "unclear error: {m}");
            }
        }
    }
}
