//! The schedule's transfer operations on the GPU: page-locking the host store's slabs, events,
//! and asynchronous copies between slabs and device buffers in the buffers' own dtype, queued on
//! the stream the schedule names and ordered by its events; and the upload of fp32 master weights
//! into bf16 buffers, cast on the device as they arrive.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys as cu;
use cudarc::driver::{CudaContext, CudaStream};

use super::device::{self, drv, grid_1d};
use super::{Cuda, Floats, View, ViewMut, check};
use crate::error::Result;
use crate::store::{HostSlab, PinGuard};

/// Unregisters a slab's pages when it is freed.
struct Registered {
    ptr: usize,
    ctx: std::sync::Arc<cudarc::driver::CudaContext>,
}

impl PinGuard for Registered {}

impl Drop for Registered {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `ptr` was registered by `pin` and is unregistered once, before it is freed.
        let _ = unsafe { cu::cuMemHostUnregister(self.ptr as *mut c_void) };
    }
}

/// A CUDA event created with blocking sync (a host thread waiting on it sleeps rather than
/// spinning on a core the optimizer's pool could use) and no timing (cheaper to record).
pub struct Event {
    raw: cu::CUevent,
    ctx: Arc<CudaContext>,
}

// SAFETY: a CUevent is a driver handle usable from any thread once its context is bound, which
// every method does first.
unsafe impl Send for Event {}
// SAFETY: as above; recording, waiting and synchronizing are thread-safe driver calls.
unsafe impl Sync for Event {}

impl Event {
    pub(super) fn new(ctx: &Arc<CudaContext>) -> Result<Event> {
        drv("binding the context", ctx.bind_to_thread())?;
        let flags = cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
            | cu::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32;
        let mut raw = std::mem::MaybeUninit::uninit();
        // SAFETY: `raw` is a valid out-pointer; the flags are documented `CUevent_flags` bits.
        let raw = unsafe {
            drv("creating an event", cu::cuEventCreate(raw.as_mut_ptr(), flags).result())?;
            raw.assume_init()
        };
        Ok(Event { raw, ctx: ctx.clone() })
    }

    pub(super) fn record(&self, stream: &CudaStream) -> Result<()> {
        drv("binding the context", self.ctx.bind_to_thread())?;
        // SAFETY: both handles are live and belong to this context.
        drv("recording an event", unsafe {
            cu::cuEventRecord(self.raw, stream.cu_stream()).result()
        })
    }

    pub(super) fn wait_on(&self, stream: &CudaStream) -> Result<()> {
        drv("binding the context", self.ctx.bind_to_thread())?;
        // SAFETY: both handles are live and belong to this context; flags 0 is the default.
        drv("waiting for an event", unsafe {
            cu::cuStreamWaitEvent(stream.cu_stream(), self.raw, 0).result()
        })
    }

    pub(super) fn synchronize(&self) -> Result<()> {
        drv("binding the context", self.ctx.bind_to_thread())?;
        // SAFETY: the event is live.
        drv("synchronizing with an event", unsafe { cu::cuEventSynchronize(self.raw).result() })
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: the event is destroyed once; the driver defers it if work is still pending.
        let _ = unsafe { cu::cuEventDestroy_v2(self.raw) };
    }
}

impl Cuda {
    /// Page-locks a slab: cached, not write-combined, since the CPU reads it too, and portable,
    /// so every GPU's context can copy to and from it (the ranks of a data-parallel group share
    /// one host store, pinned once).
    pub(super) fn pin_slab(&self, slab: &mut HostSlab) -> Result<()> {
        if slab.is_pinned() || slab.bytes() == 0 {
            return Ok(());
        }
        self.bind()?;
        let ptr = slab.as_mut_ptr();
        // SAFETY: the slab owns `bytes` bytes at `ptr` (page-aligned) for as long as the guard
        // lives; the guard unregisters them before the slab frees its memory.
        drv("cuMemHostRegister", unsafe {
            cu::cuMemHostRegister_v2(
                ptr.cast::<c_void>(),
                slab.bytes(),
                cu::CU_MEMHOSTREGISTER_PORTABLE,
            )
            .result()
        })?;
        slab.set_pin_guard(Box::new(Registered { ptr: ptr as usize, ctx: self.ctx.clone() }));
        Ok(())
    }

    /// Byte range of a view's data inside a slab, checked.
    fn slab_span(op: &str, slab: &HostSlab, offset: usize, bytes: usize) -> Result<()> {
        match offset.checked_add(bytes) {
            Some(end) if end <= slab.bytes() => Ok(()),
            _ => Err(check::err(
                op,
                format!("{bytes} bytes at {offset} do not fit a host slab of {}", slab.bytes()),
            )),
        }
    }

    /// # Safety
    /// As [`crate::backend::Device::upload_on`]: the copy runs after this returns.
    pub(super) unsafe fn upload_slab(
        &self,
        stream: &CudaStream,
        dst: ViewMut<'_>,
        src: &HostSlab,
        offset: usize,
    ) -> Result<()> {
        let bytes = dst.len * dst.buf.elem_bytes();
        Self::slab_span("upload_on", src, offset, bytes)?;
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        let ptr = self.ptr_mut(&dst);
        let host = &src.as_bytes()[offset..offset + bytes];
        // SAFETY: `ptr` addresses exactly `bytes` bytes of the destination view; the caller
        // keeps `host` unchanged and both ends allocated until the copy has completed.
        drv("upload_on", unsafe {
            cudarc::driver::result::memcpy_htod_async(ptr, host, stream.cu_stream())
        })
    }

    /// # Safety
    /// As [`crate::backend::Device::upload_f32_on`]: the copies and casts run after this
    /// returns.
    pub(super) unsafe fn upload_cast_slab(
        &self,
        stream: &CudaStream,
        dst: ViewMut<'_>,
        src: &HostSlab,
        offset: usize,
        staging: Option<&mut Floats>,
    ) -> Result<()> {
        if let Floats::F32(_) = dst.buf {
            // SAFETY: the same dtype on both ends: a plain upload, under the same contract.
            return unsafe { self.upload_slab(stream, dst, src, offset) };
        }
        let len = dst.len;
        Self::slab_span("upload_f32_on", src, offset, len * 4)?;
        let staging = match staging {
            Some(Floats::F32(s)) if !s.is_empty() => s,
            _ => {
                return Err(check::err(
                    "upload_f32_on",
                    "a bf16 destination needs a non-empty f32 staging buffer".to_string(),
                ));
            }
        };
        if len == 0 {
            return Ok(());
        }
        self.bind()?;
        let chunk = staging.len();
        let stage = device::base_ptr(staging, stream);
        let out = self.ptr_mut(&dst);
        let host = &src.as_bytes()[offset..offset + len * 4];
        let convert = self.kernels.get("convert")?;
        for start in (0..len).step_by(chunk) {
            let n = chunk.min(len - start);
            let part = &host[start * 4..(start + n) * 4];
            // SAFETY: `stage` holds `chunk >= n` f32s; the caller keeps `part` unchanged and
            // the staging buffer to this stream until the work queued here has completed. The
            // cast below is queued after this copy on the same stream, and the next chunk's copy
            // after that cast, so each chunk is read only once it has arrived and overwritten
            // only once it has been cast.
            drv("upload_f32_on", unsafe {
                cudarc::driver::result::memcpy_htod_async(stage, part, stream.cu_stream())
            })?;
            device::launch(
                stream,
                convert,
                "convert",
                grid_1d(n),
                &super::kernel::convert {
                    dst: out + (start * 2) as u64,
                    dst_f32: 0,
                    src: stage,
                    src_f32: 1,
                    n: n as i64,
                },
            )?;
        }
        Ok(())
    }

    /// # Safety
    /// As [`crate::backend::Device::download_on`]: the copy runs after this returns.
    pub(super) unsafe fn download_slab(
        &self,
        stream: &CudaStream,
        dst: &mut HostSlab,
        offset: usize,
        src: View<'_>,
    ) -> Result<()> {
        let bytes = src.len * src.buf.elem_bytes();
        Self::slab_span("download_on", dst, offset, bytes)?;
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        let ptr = self.ptr(&src);
        let host = &mut dst.as_bytes_mut()[offset..offset + bytes];
        // SAFETY: `ptr` addresses exactly `bytes` bytes of the source view; the caller keeps
        // `host` allocated and untouched, and the source alive, until the copy has completed.
        drv("download_on", unsafe {
            cudarc::driver::result::memcpy_dtoh_async(host, ptr, stream.cu_stream())
        })
    }
}
