//! The schedule's transfer operations on the GPU: page-locking the host store's slabs and copies
//! between slabs and device buffers in the buffers' own dtype.
//!
//! For now every transfer is queued on the compute stream and waited for before returning, so
//! the schedule's streams and events need no device-side ordering yet: the three streams exist,
//! but overlapping transfers with compute is the next step for this backend.

use std::ffi::c_void;

use cudarc::driver::sys as cu;

use super::device::drv;
use super::{Cuda, View, ViewMut, check};
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

impl Cuda {
    /// Page-locks a slab (flags 0: cached, not write-combined, since the CPU reads it too).
    pub(super) fn pin_slab(&self, slab: &mut HostSlab) -> Result<()> {
        if slab.is_pinned() || slab.bytes() == 0 {
            return Ok(());
        }
        self.bind()?;
        let ptr = slab.as_mut_ptr();
        // SAFETY: the slab owns `bytes` bytes at `ptr` (page-aligned) for as long as the guard
        // lives; the guard unregisters them before the slab frees its memory.
        drv("cuMemHostRegister", unsafe {
            cu::cuMemHostRegister_v2(ptr.cast::<c_void>(), slab.bytes(), 0).result()
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

    pub(super) fn upload_slab(
        &self,
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
        // SAFETY: `ptr` addresses exactly `bytes` bytes of the destination view; `host` stays
        // borrowed until the copy has finished (we synchronize below).
        drv("upload_on", unsafe {
            cudarc::driver::result::memcpy_htod_async(ptr, host, self.compute.cu_stream())
        })?;
        self.synchronize()
    }

    pub(super) fn download_slab(
        &self,
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
        // SAFETY: `ptr` addresses exactly `bytes` bytes of the source view; `host` stays
        // borrowed until the copy has finished (we synchronize below).
        drv("download_on", unsafe {
            cudarc::driver::result::memcpy_dtoh_async(host, ptr, self.compute.cu_stream())
        })?;
        self.synchronize()
    }
}
