//! Per-step uploads through one pinned arena: a step's small host arrays (positions, block
//! tables, token ids, row lists, sampling settings) are written into page-locked host memory at
//! bump-allocated offsets and copied asynchronously to the same offsets of a device twin, so an
//! upload neither allocates nor waits for the GPU.
//!
//! The fixed addresses are also what CUDA graphs need: a decode graph captures each of these
//! copies as a node reading a fixed pinned address, and replaying it means writing the next
//! step's arrays at the same offsets (the forward runs again with launches suppressed, so the
//! offsets repeat) and launching the graph.
//!
//! Reuse is safe only once the GPU has consumed earlier copies: the arena is reset at the start
//! of a forward after a stream synchronization (see `CudaBackend::stage`). Arrays that do not
//! fit go through ordinary allocations kept alive until that reset.

use std::ffi::c_void;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, result};

use crate::error::{Error, Result};

/// Offsets are aligned for any element type and for coalesced reads.
pub const ALIGN: usize = 256;

/// The arena's bookkeeping, apart from memory: which bytes a request gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bump {
    pub capacity: usize,
    pub used: usize,
}

impl Bump {
    /// The offset of `bytes` new bytes, or `None` when they do not fit.
    pub fn take(&mut self, bytes: usize) -> Option<usize> {
        let at = self.used.next_multiple_of(ALIGN);
        let end = at.checked_add(bytes)?;
        if end > self.capacity {
            return None;
        }
        self.used = end;
        Some(at)
    }

    pub fn reset(&mut self) {
        self.used = 0;
    }
}

/// Page-locked host memory from the driver.
struct Pinned {
    ptr: *mut u8,
}

// SAFETY: the pointer is owned memory, written only under the backend's staging lock.
unsafe impl Send for Pinned {}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_host and freed once.
        let _ = unsafe { result::free_host(self.ptr as *mut c_void) };
    }
}

pub struct Staging {
    host: Pinned,
    device: CudaSlice<u8>,
    pub bump: Bump,
    /// Arrays that did not fit, kept until the next reset.
    spilled: Vec<CudaSlice<u8>>,
}

impl Staging {
    pub fn new(stream: &std::sync::Arc<CudaStream>, capacity: usize) -> Result<Staging> {
        let dev_err = |what: &str, e: cudarc::driver::DriverError| {
            Error::Device(format!("CUDA staging arena ({what}): {e:?}"))
        };
        // SAFETY: a plain pinned allocation of `capacity` bytes, owned by `Pinned`.
        let ptr = unsafe { result::malloc_host(capacity.max(1), 0) }
            .map_err(|e| dev_err("pinned host memory", e))? as *mut u8;
        let host = Pinned { ptr };
        let device = stream
            .alloc_zeros::<u8>(capacity.max(1))
            .map_err(|e| dev_err("device memory", e))?;
        Ok(Staging {
            host,
            device,
            bump: Bump { capacity, used: 0 },
            spilled: Vec::new(),
        })
    }

    /// Forgets every region; the caller has synchronized the stream since they were copied.
    pub fn reset(&mut self) {
        self.bump.reset();
        self.spilled.clear();
    }

    /// Writes `values` into the arena and, when `copy`, enqueues their copy to the device twin.
    /// Returns the device address, or `None` when the arena is full.
    pub fn push<T: Copy>(
        &mut self,
        stream: &std::sync::Arc<CudaStream>,
        values: &[T],
        copy: bool,
    ) -> Result<Option<u64>> {
        let bytes = std::mem::size_of_val(values);
        let Some(at) = self.bump.take(bytes) else {
            return Ok(None);
        };
        // SAFETY: [at, at + bytes) lies inside the pinned allocation (Bump checked it), the GPU
        // has finished reading it (reset only follows a synchronization), and T is plain data.
        let host = unsafe {
            let dst = self.host.ptr.add(at);
            std::ptr::copy_nonoverlapping(values.as_ptr() as *const u8, dst, bytes);
            std::slice::from_raw_parts(dst as *const u8, bytes)
        };
        let ptr = self.device.device_ptr(stream).0 + at as u64;
        if copy && bytes > 0 {
            // SAFETY: both ranges are `bytes` long inside their allocations; the pinned source
            // stays untouched until the next reset, after the copy ran.
            unsafe { result::memcpy_htod_async(ptr, host, stream.cu_stream()) }
                .map_err(|e| Error::Device(format!("CUDA staged copy: {e:?}")))?;
        }
        Ok(Some(ptr))
    }

    /// An array that did not fit: an ordinary allocation, alive until the next reset.
    pub fn spill<T: Copy + cudarc::driver::DeviceRepr>(
        &mut self,
        stream: &std::sync::Arc<CudaStream>,
        values: &[T],
    ) -> Result<u64> {
        let bytes = std::mem::size_of_val(values);
        // SAFETY: a byte view of plain data.
        let raw = unsafe { std::slice::from_raw_parts(values.as_ptr() as *const u8, bytes) };
        let slice = stream
            .clone_htod(raw)
            .map_err(|e| Error::Device(format!("CUDA copy to the device: {e:?}")))?;
        let ptr = slice.device_ptr(stream).0;
        self.spilled.push(slice);
        Ok(ptr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_are_aligned_disjoint_and_refused_past_the_end() {
        let mut b = Bump {
            capacity: 1024,
            used: 0,
        };
        assert_eq!(b.take(10), Some(0));
        assert_eq!(b.take(300), Some(256));
        assert_eq!(b.take(0), Some(768));
        assert_eq!(b.take(257), None, "768 + 257 is past 1024");
        assert_eq!(b.take(256), Some(768));
        assert_eq!(b.take(1), None);
        b.reset();
        // After a reset the same requests get the same offsets (what a graph replay relies on).
        assert_eq!((b.take(10), b.take(300)), (Some(0), Some(256)));
        assert_eq!(b.take(usize::MAX), None);
    }
}
