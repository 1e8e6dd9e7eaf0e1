//! `HostSlab`: a page-aligned, zero-initialised block of host memory that a backend may
//! page-lock for DMA. One slab holds one unit's master weights, streaming copy, gradients or checkpoints, so a
//! transfer is a single burst.
//!
//! Large host buffers ask the kernel for transparent huge pages. The optimizer streams the whole
//! training state through the cores once per step, and with 4 KiB pages every 4 KiB of every
//! array costs a TLB miss (a two-level page walk in a virtual machine); 2 MiB pages make those
//! misses 512 times rarer. On the GPU machine this measured within noise of 4 KiB pages for the
//! update without software prefetch (`sluice bench adam --pages small|huge`), and the fastest
//! configuration measured ran on huge pages. It is advice only: where the kernel has huge pages
//! disabled, the memory is ordinary memory.

use std::ptr::NonNull;

use crate::error::Result;

/// Alignment of every slab: at least a page, so page-locking never spans a foreign allocation
/// and DMA engines see aligned bursts. Slabs of [`HUGE_PAGE`] bytes or more start on a huge-page
/// boundary.
pub const SLAB_ALIGN: usize = 4096;

/// The x86-64 transparent huge page (a PMD mapping).
pub const HUGE_PAGE: usize = 2 << 20;

/// Which pages a large buffer should live on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pages {
    /// Transparent huge pages where the kernel allows them (`madvise(MADV_HUGEPAGE)`).
    Huge,
    /// Base pages only (`MADV_NOHUGEPAGE`): what the optimizer saw before huge pages, kept so
    /// `sluice bench adam --pages small` can measure the difference.
    Small,
}

/// Undoes a backend's page-locking when the slab is freed (e.g. `cuMemHostUnregister`).
pub trait PinGuard: Send + Sync {}

pub struct HostSlab {
    ptr: NonNull<u8>,
    bytes: usize,
    /// Length of the mapping at `ptr` (`bytes` rounded up to whole pages, at least one).
    mapped: usize,
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
    /// `bytes` of zeroed memory on huge pages where possible (a zero-length slab still owns one
    /// page, so the pointer is real). The pages are not touched here: each is faulted in by the
    /// first thread that writes it (the optimizer pool, or the backend when it page-locks).
    pub fn zeroed(bytes: usize) -> Result<HostSlab> {
        HostSlab::zeroed_on(bytes, Pages::Huge)
    }

    /// [`HostSlab::zeroed`] with a choice of pages.
    pub fn zeroed_on(bytes: usize, pages: Pages) -> Result<HostSlab> {
        let (ptr, mapped) = map::zeroed(bytes, pages)?;
        Ok(HostSlab { ptr, bytes, mapped, pin: None })
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
        // SAFETY: `ptr` and `mapped` came from `map::zeroed` and are released once, here; no
        // borrow of the memory outlives `self`.
        unsafe { map::release(self.ptr, self.mapped) }
    }
}

/// A zeroed `Vec<f32>` of `n` elements whose interior whole huge pages are advised as `pages`
/// says. Use it for large f32 state (master weights, Adam moments): for the sizes of a unit the
/// allocator maps fresh, untouched memory, so the advice is in place before the first write
/// faults each page in.
pub fn zeroed_f32_vec(n: usize, pages: Pages) -> Vec<f32> {
    let v = vec![0.0f32; n];
    advise(v.as_ptr().cast(), n * 4, pages);
    v
}

/// Advises the whole huge pages inside `[ptr, ptr + bytes)`; the partial pages at either end are
/// left alone, since they may belong to other allocations. Advice is best-effort: a kernel
/// without transparent huge pages refuses it and the memory stays usable as it is.
fn advise(ptr: *const u8, bytes: usize, pages: Pages) {
    let start = (ptr as usize).next_multiple_of(HUGE_PAGE);
    let end = (ptr as usize + bytes) / HUGE_PAGE * HUGE_PAGE;
    if end > start {
        map::advise(start, end - start, pages);
    }
}

/// Page-granular memory from the operating system: anonymous mappings on Unix, which arrive
/// zeroed and untouched; the global allocator elsewhere.
mod map {
    use std::ptr::NonNull;

    use super::{HUGE_PAGE, Pages, SLAB_ALIGN};
    use crate::error::{Error, Result};

    fn out_of_memory(bytes: usize) -> Error {
        Error::invalid(format!("out of host memory allocating {bytes} bytes"))
    }

    /// Maps `bytes` (rounded up to whole pages, at least one) of zeroed memory, aligned to a
    /// huge page when it is at least one huge page long. Returns the start and mapped length.
    #[cfg(unix)]
    pub(super) fn zeroed(bytes: usize, pages: Pages) -> Result<(NonNull<u8>, usize)> {
        let len = bytes
            .max(1)
            .checked_next_multiple_of(SLAB_ALIGN)
            .ok_or_else(|| out_of_memory(bytes))?;
        // Over-map by one huge page so an aligned start exists, then hand the slack back.
        let slack = if len >= HUGE_PAGE { HUGE_PAGE } else { 0 };
        let total = len.checked_add(slack).ok_or_else(|| out_of_memory(bytes))?;
        // SAFETY: an anonymous private mapping at an address of the kernel's choosing touches
        // no existing memory.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(out_of_memory(bytes));
        }
        let base = raw as usize;
        let start = if slack > 0 { base.next_multiple_of(HUGE_PAGE) } else { base };
        let (head, tail) = (start - base, base + total - (start + len));
        for (at, n) in [(base, head), (start + len, tail)] {
            if n > 0 {
                // SAFETY: `[at, at + n)` lies inside the mapping made above, outside the part
                // kept, and nothing refers to it.
                unsafe { libc::munmap(at as *mut libc::c_void, n) };
            }
        }
        if len >= HUGE_PAGE {
            advise(start, len / HUGE_PAGE * HUGE_PAGE, pages);
        }
        let ptr = NonNull::new(start as *mut u8).ok_or_else(|| out_of_memory(bytes))?;
        Ok((ptr, len))
    }

    /// # Safety
    /// `ptr` and `len` must come from one call of [`zeroed`], released once, with no live
    /// reference into the memory.
    #[cfg(unix)]
    pub(super) unsafe fn release(ptr: NonNull<u8>, len: usize) {
        // SAFETY: the caller passes a mapping of exactly this extent that nothing uses.
        unsafe { libc::munmap(ptr.as_ptr().cast(), len) };
    }

    #[cfg(not(unix))]
    pub(super) fn zeroed(bytes: usize, _pages: Pages) -> Result<(NonNull<u8>, usize)> {
        let len = bytes
            .max(1)
            .checked_next_multiple_of(SLAB_ALIGN)
            .ok_or_else(|| out_of_memory(bytes))?;
        let align = if len >= HUGE_PAGE { HUGE_PAGE } else { SLAB_ALIGN };
        let layout = std::alloc::Layout::from_size_align(len, align)
            .map_err(|e| Error::invalid(format!("host buffer of {bytes} bytes: {e}")))?;
        // SAFETY: `layout` has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        Ok((NonNull::new(raw).ok_or_else(|| out_of_memory(bytes))?, len))
    }

    /// # Safety
    /// As for the Unix version.
    #[cfg(not(unix))]
    pub(super) unsafe fn release(ptr: NonNull<u8>, len: usize) {
        let align = if len >= HUGE_PAGE { HUGE_PAGE } else { SLAB_ALIGN };
        // SAFETY: `zeroed` allocated exactly this layout for this length.
        unsafe {
            std::alloc::dealloc(
                ptr.as_ptr(),
                std::alloc::Layout::from_size_align_unchecked(len, align),
            )
        };
    }

    /// Page advice for `[start, start + len)`, both huge-page aligned.
    #[cfg(target_os = "linux")]
    pub(super) fn advise(start: usize, len: usize, pages: Pages) {
        let advice = match pages {
            Pages::Huge => libc::MADV_HUGEPAGE,
            Pages::Small => libc::MADV_NOHUGEPAGE,
        };
        // SAFETY: advice changes how the range is backed, never its contents or validity; the
        // range lies inside memory the caller owns. A refusal (no THP in this kernel) is fine.
        unsafe { libc::madvise(start as *mut libc::c_void, len, advice) };
    }

    #[cfg(not(target_os = "linux"))]
    pub(super) fn advise(_start: usize, _len: usize, _pages: Pages) {}
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

    #[test]
    fn large_slabs_start_on_a_huge_page_and_are_usable_to_the_end() {
        for pages in [Pages::Huge, Pages::Small] {
            let bytes = 3 * HUGE_PAGE + 12;
            let mut s = HostSlab::zeroed_on(bytes, pages).unwrap();
            assert_eq!(s.as_ptr() as usize % HUGE_PAGE, 0, "{pages:?}");
            assert_eq!(s.as_bytes().len(), bytes);
            assert!(s.as_bytes().iter().all(|&b| b == 0));
            let n = s.as_u16().len();
            s.as_u16_mut()[n - 1] = 7;
            assert_eq!(s.as_u16()[n - 1], 7);
        }
    }

    #[test]
    fn zeroed_f32_vecs_are_plain_zeroed_vecs() {
        for n in [0, 5, HUGE_PAGE + 3] {
            let mut v = zeroed_f32_vec(n, Pages::Huge);
            assert_eq!(v.len(), n);
            assert!(v.iter().all(|&x| x == 0.0));
            v.push(1.0); // an ordinary Vec: it may grow and is freed by the global allocator
            assert_eq!(v[n], 1.0);
        }
    }
}
