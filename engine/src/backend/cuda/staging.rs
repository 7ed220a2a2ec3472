//! Per-step uploads through pinned arenas: a step's small host arrays (positions, block tables,
//! token ids, row lists, sampling settings) are written into page-locked host memory at
//! bump-allocated offsets and copied asynchronously to the same offsets of a device twin, so an
//! upload neither allocates nor waits for the GPU.
//!
//! Two host arenas take turns, one per forward, so the host may stage step N+1 while the GPU
//! still copies step N's inputs (overlap scheduling): an arena is written again only after the
//! work enqueued while it was current has finished (an event per arena). One device twin is
//! enough: every copy and kernel runs on one stream, so step N+1's copy into the twin lands after
//! step N's kernels have read it.
//!
//! Decode graphs read the twin's fixed addresses. A recording stages without copying (its
//! kernels are recorded, not run); a replay runs the same forward on the host with launches
//! suppressed, so each array lands at the offset the recording used, and then one copy of the
//! whole staged range precedes the graph's launch.
//!
//! Arrays that do not fit go through ordinary allocations kept alive until their arena's turn
//! comes again.

use std::ffi::c_void;

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr, result};

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
pub struct Pinned {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the pointer is owned memory, written only under its owner's lock.
unsafe impl Send for Pinned {}

impl Pinned {
    pub fn new(len: usize) -> Result<Pinned> {
        // SAFETY: a plain pinned allocation of `len` bytes, owned by the result.
        let ptr = unsafe { result::malloc_host(len.max(1), 0) }
            .map_err(|e| Error::Device(format!("pinned host memory ({len} bytes): {e:?}")))?
            as *mut u8;
        Ok(Pinned { ptr, len })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_host and freed once.
        let _ = unsafe { result::free_host(self.ptr as *mut c_void) };
    }
}

/// One host arena and what must finish before it is written again.
struct Arena {
    host: Pinned,
    /// Recorded when the arena stopped being current (`None`: never used).
    done: Option<CudaEvent>,
    /// Arrays that did not fit, kept until the arena's next turn.
    spilled: Vec<CudaSlice<u8>>,
}

pub struct Staging {
    arenas: [Arena; 2],
    current: usize,
    device: CudaSlice<u8>,
    pub bump: Bump,
}

impl Staging {
    pub fn new(stream: &std::sync::Arc<CudaStream>, capacity: usize) -> Result<Staging> {
        let arena = || -> Result<Arena> {
            Ok(Arena {
                host: Pinned::new(capacity)?,
                done: None,
                spilled: Vec::new(),
            })
        };
        let device = stream
            .alloc_zeros::<u8>(capacity.max(1))
            .map_err(|e| Error::Device(format!("CUDA staging arena (device memory): {e:?}")))?;
        Ok(Staging {
            arenas: [arena()?, arena()?],
            current: 0,
            device,
            bump: Bump { capacity, used: 0 },
        })
    }

    /// Turns to the other arena: marks the work enqueued so far as what the current one waits
    /// on, then waits (usually not at all) for the other one's mark.
    pub fn restart(&mut self, stream: &std::sync::Arc<CudaStream>) -> Result<()> {
        let mark = stream
            .record_event(None)
            .map_err(|e| Error::DeviceLost(format!("CUDA event record: {e:?}")))?;
        self.arenas[self.current].done = Some(mark);
        self.current ^= 1;
        let next = &mut self.arenas[self.current];
        if let Some(done) = next.done.take() {
            done.synchronize()
                .map_err(|e| Error::DeviceLost(format!("CUDA event wait: {e:?}")))?;
        }
        next.spilled.clear();
        self.bump.reset();
        Ok(())
    }

    /// Copies everything staged since the restart to the device twin in one go (a graph
    /// replay's inputs).
    pub fn upload_staged(&self, stream: &std::sync::Arc<CudaStream>) -> Result<()> {
        let bytes = self.bump.used;
        if bytes == 0 {
            return Ok(());
        }
        let host = &self.arenas[self.current].host;
        // SAFETY: [0, used) of the current arena was written by `push` and stays untouched
        // until this arena's next turn, after the copy ran.
        let src = unsafe { std::slice::from_raw_parts(host.as_ptr(), bytes) };
        let dst = self.device.device_ptr(stream).0;
        // SAFETY: both ranges are `bytes` long inside their allocations.
        unsafe { result::memcpy_htod_async(dst, src, stream.cu_stream()) }
            .map_err(|e| Error::DeviceLost(format!("CUDA staged copy: {e:?}")))
    }

    /// Writes `values` into the current arena and, when `copy`, enqueues their copy to the
    /// device twin. Returns the device address, or `None` when the arena is full.
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
        let arena = &mut self.arenas[self.current];
        // SAFETY: [at, at + bytes) lies inside the pinned allocation (Bump checked it against
        // the capacity both arenas have), the GPU has finished with this arena's last turn
        // (`restart` waited), and T is plain data.
        let host = unsafe {
            let dst = arena.host.as_mut_ptr().add(at);
            std::ptr::copy_nonoverlapping(values.as_ptr() as *const u8, dst, bytes);
            std::slice::from_raw_parts(dst as *const u8, bytes)
        };
        let ptr = self.device.device_ptr(stream).0 + at as u64;
        if copy && bytes > 0 {
            // SAFETY: both ranges are `bytes` long inside their allocations; the pinned source
            // stays untouched until this arena's next turn, after the copy ran.
            unsafe { result::memcpy_htod_async(ptr, host, stream.cu_stream()) }
                .map_err(|e| Error::DeviceLost(format!("CUDA staged copy: {e:?}")))?;
        }
        Ok(Some(ptr))
    }

    /// An array that did not fit: an ordinary allocation, alive until this arena's next turn.
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
            .map_err(|e| Error::DeviceLost(format!("CUDA copy to the device: {e:?}")))?;
        let ptr = slice.device_ptr(stream).0;
        self.arenas[self.current].spilled.push(slice);
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
