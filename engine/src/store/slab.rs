//! `HostSlab`: a 4 KiB-aligned, zero-initialised block of host memory that a backend may
//! page-lock for DMA. One slab holds one unit's streaming copy, gradients or checkpoints, so a
//! transfer is a single burst.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;

use crate::error::{Error, Result};

/// Alignment of every slab: a page, so page-locking never spans a foreign allocation and DMA
/// engines see aligned bursts.
pub const SLAB_ALIGN: usize = 4096;

/// Undoes a backend's page-locking when the slab is freed (e.g. `cuMemHostUnregister`).
pub trait PinGuard: Send + Sync {}

pub struct HostSlab {
    ptr: NonNull<u8>,
    bytes: usize,
    layout: Layout,
    /// Dropped before the memory is freed.
    pin: Option<Box<dyn PinGuard>>,
}

// SAFETY: a slab owns its memory exclusively (like a `Vec<u8>`); shared access only hands out
// `&[T]`, and mutable access requires `&mut self`.
unsafe impl Send for HostSlab {}
// SAFETY: as above: `&HostSlab` only allows reads.
unsafe impl Sync for HostSlab {}

impl std::fmt::Debug for HostSlab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostSlab")
            .field("bytes", &self.bytes)
            .field("pinned", &self.pin.is_some())
            .finish()
    }
}

impl HostSlab {
    /// `bytes` of zeroed memory (a zero-length slab still owns one page, so the pointer is real).
    pub fn zeroed(bytes: usize) -> Result<HostSlab> {
        let size = bytes.max(1).div_ceil(SLAB_ALIGN) * SLAB_ALIGN;
        let layout = Layout::from_size_align(size, SLAB_ALIGN)
            .map_err(|e| Error::invalid(format!("host buffer of {bytes} bytes: {e}")))?;
        // SAFETY: `layout` has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| {
            Error::invalid(format!("out of host memory allocating {bytes} bytes"))
        })?;
        Ok(HostSlab { ptr, bytes, layout, pin: None })
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Start of the memory, for backends that register or copy it.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Whether a backend page-locked this slab.
    pub fn is_pinned(&self) -> bool {
        self.pin.is_some()
    }

    /// Records the backend's page-locking; the guard is dropped before the memory is freed.
    pub fn set_pin_guard(&mut self, guard: Box<dyn PinGuard>) {
        self.pin = Some(guard);
    }

    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: `ptr` points to `layout.size() >= bytes` initialised (zeroed) bytes owned by
        // this slab for its whole life.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.bytes) }
    }

    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_bytes`, and `&mut self` guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.bytes) }
    }

    pub fn as_f32(&self) -> &[f32] {
        // SAFETY: the memory is 4096-aligned (so f32-aligned), initialised, and any bit pattern
        // is a valid f32; the length is rounded down to whole elements.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().cast::<f32>(), self.bytes / 4) }
    }

    pub fn as_f32_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in `as_f32`, with exclusive access through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().cast::<f32>(), self.bytes / 4) }
    }

    pub fn as_u16(&self) -> &[u16] {
        // SAFETY: as in `as_f32`, for 2-byte elements.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().cast::<u16>(), self.bytes / 2) }
    }

    pub fn as_u16_mut(&mut self) -> &mut [u16] {
        // SAFETY: as in `as_u16`, with exclusive access through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().cast::<u16>(), self.bytes / 2) }
    }
}

impl Drop for HostSlab {
    fn drop(&mut self) {
        // Unpin before freeing: the driver must forget the range while it is still ours.
        drop(self.pin.take());
        // SAFETY: `ptr` was allocated with exactly `layout` and is freed once, here.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slabs_are_aligned_zeroed_and_typed() {
        let mut s = HostSlab::zeroed(10_000).unwrap();
        assert_eq!(s.as_ptr() as usize % SLAB_ALIGN, 0);
        assert!(s.as_bytes().iter().all(|&b| b == 0));
        assert_eq!(s.as_f32().len(), 2500);
        s.as_f32_mut()[3] = 1.5;
        assert_eq!(s.as_f32()[3], 1.5);
        assert_eq!(s.as_u16().len(), 5000);
        let empty = HostSlab::zeroed(0).unwrap();
        assert!(empty.as_f32().is_empty());
    }
}
