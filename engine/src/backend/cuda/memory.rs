//! Uploads, downloads, zeroing and copies. Host data is f32 on the trait's side; bf16 buffers
//! are converted on the host (round to nearest even, as `half` does) through a pinned staging
//! buffer, and the copy completes before the call returns.

use half::bf16;
use rayon::prelude::*;

use super::device::{PinnedBuffer, drv, grid_1d};
use super::kernel;
use super::{Cuda, Floats, Ints, View, ViewMut, check};
use crate::error::Result;

/// Elements converted per rayon task.
const CONVERT_CHUNK: usize = 1 << 16;

impl Cuda {
    /// Grows the staging buffer to at least `bytes` and returns it locked.
    fn staging(&self, bytes: usize) -> Result<std::sync::MutexGuard<'_, PinnedBuffer>> {
        let mut staging =
            self.staging.lock().map_err(|_| check::err("upload", "staging buffer poisoned"))?;
        if staging.bytes() < bytes {
            // Grow by half again so a sequence of slightly larger copies reallocates rarely.
            *staging = PinnedBuffer::new(&self.ctx, bytes.max(staging.bytes() * 3 / 2))?;
        }
        Ok(staging)
    }

    pub(super) fn upload_floats(&self, dst: ViewMut<'_>, src: &[f32]) -> Result<()> {
        check::len("upload", "src", src.len(), &[dst.len])?;
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        let ptr = self.ptr_mut(&dst);
        let mut staging = self.staging(src.len() * 4)?;
        match dst.buf {
            Floats::Bf16(_) => {
                let host = staging.slice_mut::<u16>(src.len())?;
                host.par_chunks_mut(CONVERT_CHUNK).zip(src.par_chunks(CONVERT_CHUNK)).for_each(
                    |(h, s)| {
                        h.iter_mut().zip(s).for_each(|(h, &s)| *h = bf16::from_f32(s).to_bits())
                    },
                );
                // SAFETY: `ptr` addresses `src.len()` bf16 elements of the destination view.
                drv("upload", unsafe {
                    cudarc::driver::result::memcpy_htod_async(ptr, &*host, self.compute.cu_stream())
                })?;
            }
            Floats::F32(_) => {
                let host = staging.slice_mut::<f32>(src.len())?;
                host.copy_from_slice(src);
                // SAFETY: `ptr` addresses `src.len()` f32 elements of the destination view.
                drv("upload", unsafe {
                    cudarc::driver::result::memcpy_htod_async(ptr, &*host, self.compute.cu_stream())
                })?;
            }
        }
        // The staging buffer is reused by the next call: wait for this copy to finish.
        self.synchronize()
    }

    pub(super) fn download_floats(&self, dst: &mut [f32], src: View<'_>) -> Result<()> {
        check::len("download", "src", src.len, &[dst.len()])?;
        if dst.is_empty() {
            return Ok(());
        }
        self.bind()?;
        let ptr = self.ptr(&src);
        let mut staging = self.staging(dst.len() * 4)?;
        match src.buf {
            Floats::Bf16(_) => {
                let host = staging.slice_mut::<u16>(dst.len())?;
                // SAFETY: `ptr` addresses `dst.len()` bf16 elements of the source view.
                drv("download", unsafe {
                    cudarc::driver::result::memcpy_dtoh_async(
                        &mut *host,
                        ptr,
                        self.compute.cu_stream(),
                    )
                })?;
                self.synchronize()?;
                dst.par_chunks_mut(CONVERT_CHUNK).zip(host.par_chunks(CONVERT_CHUNK)).for_each(
                    |(d, h)| {
                        d.iter_mut().zip(h).for_each(|(d, &h)| *d = bf16::from_bits(h).to_f32())
                    },
                );
            }
            Floats::F32(_) => {
                let host = staging.slice_mut::<f32>(dst.len())?;
                // SAFETY: `ptr` addresses `dst.len()` f32 elements of the source view.
                drv("download", unsafe {
                    cudarc::driver::result::memcpy_dtoh_async(
                        &mut *host,
                        ptr,
                        self.compute.cu_stream(),
                    )
                })?;
                self.synchronize()?;
                dst.copy_from_slice(host);
            }
        }
        Ok(())
    }

    pub(super) fn upload_int_values(&self, dst: &mut Ints, src: &[i32]) -> Result<()> {
        let capacity = dst.host.len();
        if src.len() > capacity {
            return Err(check::err(
                "upload_ints",
                format!("{} ints do not fit a buffer of {capacity}", src.len()),
            ));
        }
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        let ptr = self.ints_ptr(dst);
        // SAFETY: the device buffer holds `capacity` ≥ `src.len()` ints.
        drv("upload_ints", unsafe {
            cudarc::driver::result::memcpy_htod_async(ptr, src, self.compute.cu_stream())
        })?;
        // `src` is pageable memory the caller may free on return.
        self.synchronize()?;
        dst.host[..src.len()].copy_from_slice(src);
        Ok(())
    }

    /// The device's contents of an int buffer, whole: what was uploaded, or what an op wrote
    /// there (`moe_route`'s experts, `moe_sort`'s order and rows), which the host copy does not
    /// follow. Synchronous.
    pub fn download_ints(&self, src: &Ints) -> Result<Vec<i32>> {
        self.bind()?;
        drv("download_ints", self.compute.clone_dtoh(&src.dev))
    }

    pub(super) fn zero(&self, dst: &ViewMut<'_>) -> Result<()> {
        if dst.len == 0 {
            return Ok(());
        }
        self.bind()?;
        let bytes = dst.len * dst.buf.elem_bytes();
        // SAFETY: the view's `bytes` bytes lie inside its buffer.
        drv("fill_zero", unsafe {
            cudarc::driver::result::memset_d8_async(
                self.ptr_mut(dst),
                0,
                bytes,
                self.compute.cu_stream(),
            )
        })
    }

    pub(super) fn copy_floats(&self, dst: ViewMut<'_>, src: View<'_>) -> Result<()> {
        check::len("copy", "src", src.len, &[dst.len])?;
        if dst.len == 0 {
            return Ok(());
        }
        if dst.buf.kind() == src.kind() {
            self.bind()?;
            let bytes = dst.len * dst.buf.elem_bytes();
            // SAFETY: both views hold `bytes` bytes inside their buffers; a `&mut` destination
            // cannot overlap the shared source.
            return drv("copy", unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    self.ptr_mut(&dst),
                    self.ptr(&src),
                    bytes,
                    self.compute.cu_stream(),
                )
            });
        }
        let d = dst.as_view();
        self.launch(
            grid_1d(dst.len),
            kernel::convert {
                dst: self.ptr(&d),
                dst_f32: d.is_f32(),
                src: self.ptr(&src),
                src_f32: src.is_f32(),
                n: dst.len as i64,
            },
        )
    }
}
