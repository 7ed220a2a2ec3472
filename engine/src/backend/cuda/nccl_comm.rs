//! Tensor parallelism's sums between GPUs: one NCCL communicator per rank, over the backend's own
//! stream and buffers (the bf16 activations are summed where they live, never copied to the host).
//!
//! NCCL blocks by default — in `ncclCommInitRank` until every rank arrives, in a collective until
//! every peer's part is there — so a dead or stalled rank would hang the server. The communicator
//! is therefore created non-blocking (`blocking = 0`). Joining waits in [`await_collective`]; the
//! collectives are enqueued and left running (waiting on each would idle the GPU 122 times a
//! Kimi-K2 token) under a [`Watchdog`] thread that polls `ncclCommGetAsyncError` and an event after
//! each, watches the group's failure state, and on a deadline or a peer's failure calls
//! `ncclCommAbort`, which ends the stuck kernels; the rank learns it at the end of its step
//! (`Communicator::end_step`) and the process exits for the service manager.
//!
//! The rendezvous token (NCCL's unique id, made by rank 0) reaches the other ranks over the host
//! group ([`ThreadComm::broadcast_bytes`]): the ranks are threads of one process. Messages up to
//! `--one-shot-allreduce-max-bytes` go to the one-shot peer-to-peer kernel instead
//! ([`OneShotGpu`]), the size `kiln lock` measured it to win at.

use std::ffi::{c_char, c_int, c_void};
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::{result, sys};
use half::bf16;

use super::gpu::Gpu;
use super::oneshot::OneShotGpu;
use crate::parallel::{
    CommError, Communicator, Completion, GroupHealth, GroupOptions, Progress, ThreadComm, Watchdog,
    await_collective,
};

/// NCCL 2.17's `ncclConfig_t`, the first with `blocking`. NCCL reads a config's `size` and
/// `version` and accepts an older layout, so this one works with every NCCL from 2.17 on, whatever
/// layout the bindings were generated from. Unset fields hold NCCL's "undefined" markers, as
/// `NCCL_CONFIG_INITIALIZER` writes them.
#[repr(C)]
struct ConfigV217 {
    size: usize,
    magic: u32,
    version: u32,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
    split_share: c_int,
}

const CONFIG_MAGIC: u32 = 0xcafe_beef;
/// `NCCL_VERSION(2, 17, 0)`.
const CONFIG_VERSION: u32 = 21_700;
const UNDEF_INT: c_int = c_int::MIN;

impl ConfigV217 {
    fn non_blocking() -> ConfigV217 {
        ConfigV217 {
            size: std::mem::size_of::<ConfigV217>(),
            magic: CONFIG_MAGIC,
            version: CONFIG_VERSION,
            blocking: 0,
            cga_cluster_size: UNDEF_INT,
            min_ctas: UNDEF_INT,
            max_ctas: UNDEF_INT,
            net_name: std::ptr::null(),
            split_share: UNDEF_INT,
        }
    }
}

/// The raw communicator, shared with the watchdog thread (which may abort it). Every use holds
/// the lock, so an abort (which frees the communicator) never races a call on it: after it, the
/// handle is `None` and every use fails.
struct Handle {
    comm: Mutex<Option<CommPtr>>,
    /// Run before the abort: the rank's recorded graphs hold references on the communicator,
    /// and NCCL (2.26 on) tears a communicator down only once every graph referencing it is
    /// destroyed, so an abort with graphs alive would never return.
    before_abort: Mutex<Option<BeforeAbort>>,
    /// Graph captures and aborts, one at a time: a graph being captured holds a reference on the
    /// communicator that only ending the capture (on the capturing thread) releases, so an abort
    /// that comes during a capture waits for its end instead of spinning in NCCL, and no
    /// capture begins once an abort has.
    capture: Mutex<CaptureState>,
}

#[derive(Default)]
struct CaptureState {
    open: bool,
    /// An abort came while a capture was open: it runs when the capture ends.
    deferred: bool,
    aborted: bool,
}

/// What a rank does before its communicator is aborted (see [`Handle`]).
pub type BeforeAbort = Box<dyn Fn() + Send + Sync>;

/// `ncclComm_t` as something a mutex may hold across threads.
struct CommPtr(sys::ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread, one call at a time; the mutex around
// it makes every call, the watchdog's `ncclCommGetAsyncError` and `ncclCommAbort` included, one
// at a time.
unsafe impl Send for CommPtr {}

impl Handle {
    /// Runs `f` on the live communicator; None once it was aborted.
    fn with<R>(&self, f: impl FnOnce(sys::ncclComm_t) -> R) -> Option<R> {
        let guard = self.comm.lock().unwrap_or_else(|p| p.into_inner());
        guard.as_ref().map(|c| f(c.0))
    }

    /// Where the communicator's last call stands (`ncclInProgress` while a non-blocking call is
    /// still being set up or enqueued).
    fn async_state(&self) -> Progress {
        let polled = self.with(|comm| {
            let mut state = sys::ncclResult_t::ncclSuccess;
            // SAFETY: the communicator is live (the lock is held) and `state` outlives the call.
            let r = unsafe { sys::ncclCommGetAsyncError(comm, &mut state) };
            (r, state)
        });
        match polled {
            None => Progress::Failed("the NCCL communicator was aborted".into()),
            Some((sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclSuccess)) => {
                Progress::Done
            }
            Some((sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclInProgress)) => {
                Progress::Pending
            }
            Some((sys::ncclResult_t::ncclSuccess, failed)) | Some((failed, _)) => {
                Progress::Failed(describe(failed))
            }
        }
    }

    /// Aborts the communicator once: its pending work ends and the GPU is released. The graphs
    /// that captured its collectives go first (an in-flight one is freed when the abort has
    /// ended its kernels).
    fn abort(&self) {
        {
            let mut c = self.capture.lock().unwrap_or_else(|p| p.into_inner());
            if c.open {
                c.deferred = true;
                return;
            }
            c.aborted = true;
        }
        if let Some(release) = self
            .before_abort
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            release();
        }
        let mut guard = self.comm.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = guard.take() {
            // SAFETY: the handle was live, and no other use can start (the lock is held).
            let _ = unsafe { result::comm_abort(c.0) };
        }
    }
}

impl Handle {
    /// A graph capture on the rank's stream begins (refused once the communicator is aborted).
    fn capture_begins(&self) -> Result<(), String> {
        let mut c = self.capture.lock().unwrap_or_else(|p| p.into_inner());
        if c.aborted || c.deferred {
            return Err("the NCCL communicator was aborted".into());
        }
        c.open = true;
        Ok(())
    }

    /// The capture ended (its graph kept or dropped): an abort that came meanwhile runs now.
    fn capture_ends(&self) {
        let deferred = {
            let mut c = self.capture.lock().unwrap_or_else(|p| p.into_inner());
            c.open = false;
            std::mem::take(&mut c.deferred)
        };
        if deferred {
            self.abort();
        }
    }
}

/// A collective enqueued on the stream, as the watchdog sees it: done when the event after it
/// is, failed when NCCL reports an asynchronous error.
struct Enqueued {
    done: CudaEvent,
    handle: Arc<Handle>,
}

impl Completion for Enqueued {
    fn poll(&self) -> Progress {
        match self.handle.async_state() {
            Progress::Done => match self.done.try_is_complete() {
                Ok(true) => Progress::Done,
                Ok(false) => Progress::Pending,
                Err(e) => Progress::Failed(format!("the stream failed: {e:?}")),
            },
            other => other,
        }
    }
}

/// One rank's NCCL communicator on its GPU's stream.
pub struct NcclComm {
    handle: Arc<Handle>,
    rank: usize,
    world: usize,
    stream: Arc<CudaStream>,
    health: GroupHealth,
    /// The one-shot peer-to-peer kernel for messages up to its size, when the group uses it.
    one_shot: Option<OneShotGpu>,
    /// Watches the enqueued collectives (shared with the backend's graph replays).
    watchdog: Option<Arc<Watchdog>>,
}

/// What a graph replay's collectives answer to: a replayed graph holds NCCL calls no host code
/// enqueues, so the backend hands the watchdog one completion after each launch instead, held to
/// the group's deadline like an enqueued collective (a stalled peer aborts the communicator,
/// which ends the graph's kernels).
#[derive(Clone)]
pub struct ReplayWatch {
    rank: usize,
    handle: Arc<Handle>,
    stream: Arc<CudaStream>,
    watchdog: Arc<Watchdog>,
}

impl ReplayWatch {
    /// A capture of this rank's step begins: aborts wait for its end (see [`Handle`]).
    pub fn capture_begins(&self) -> Result<(), CommError> {
        self.handle
            .capture_begins()
            .map_err(|what| CommError::Device {
                rank: self.rank,
                what,
            })
    }

    /// The capture ended, with its graph kept (recorded) or dropped: an abort that came during
    /// it runs now (destroying the recorded graphs first). Call it with no graph lock held.
    pub fn capture_ends(&self) {
        self.handle.capture_ends();
    }

    /// Watches everything enqueued on the stream so far (the graph just launched).
    pub fn after_launch(&self) -> Result<(), CommError> {
        let done = self
            .stream
            .record_event(None)
            .map_err(|e| CommError::Device {
                rank: self.rank,
                what: format!("recording an event after a graph launch: {e:?}"),
            })?;
        self.watchdog.watch(Box::new(Enqueued {
            done,
            handle: self.handle.clone(),
        }));
        Ok(())
    }
}

/// An NCCL status in words (its name and NCCL's own message).
fn describe(r: sys::ncclResult_t) -> String {
    // SAFETY: ncclGetErrorString returns a static string for every result.
    let text = unsafe { std::ffi::CStr::from_ptr(sys::ncclGetErrorString(r)) };
    format!("{r:?} ({})", text.to_string_lossy())
}

impl NcclComm {
    /// Joins the group behind `host` on `stream`'s GPU. Every rank calls it at once; it returns
    /// when all have joined, or fails on the group's deadline or a peer's failure.
    pub fn join(gpu: &Gpu, host: &ThreadComm, opts: &GroupOptions) -> Result<NcclComm, CommError> {
        let stream = gpu.stream.clone();
        let (rank, world, health) = (host.rank(), host.world(), host.health());
        let device = |what: String| CommError::Device { rank, what };
        let mut token = [0u8; 128];
        if rank == 0 {
            match result::get_uniqueid() {
                Ok(id) => {
                    for (t, &c) in token.iter_mut().zip(id.internal.iter()) {
                        *t = c as u8;
                    }
                }
                Err(e) => {
                    health.fail();
                    return Err(device(format!("ncclGetUniqueId: {}", describe(e.0))));
                }
            }
        }
        host.broadcast_bytes(0, &mut token)?;
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        for (c, &t) in id.internal.iter_mut().zip(token.iter()) {
            *c = t as c_char;
        }
        // NCCL binds the communicator to the thread's current device.
        if let Err(e) = stream.context().bind_to_thread() {
            health.fail();
            return Err(device(format!("binding the CUDA context: {e:?}")));
        }
        let mut config = ConfigV217::non_blocking();
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` and `config` outlive the call; the config is a valid NCCL 2.17 layout.
        let started = unsafe {
            result::comm_init_rank_config(
                &mut comm,
                world as c_int,
                id,
                rank as c_int,
                (&mut config as *mut ConfigV217).cast::<sys::ncclConfig_t>(),
            )
        };
        if let Err(e) = started {
            health.fail();
            return Err(device(format!("ncclCommInitRankConfig: {}", describe(e.0))));
        }
        let handle = Arc::new(Handle {
            comm: Mutex::new(Some(CommPtr(comm))),
            before_abort: Mutex::new(None),
            capture: Mutex::new(CaptureState::default()),
        });
        let mut nccl = NcclComm {
            handle: handle.clone(),
            rank,
            world,
            stream: stream.clone(),
            health: health.clone(),
            one_shot: None,
            watchdog: None,
        };
        // Joining waits here: nothing can run before every rank has joined.
        await_collective(&health, || handle.async_state(), || handle.abort())?;
        if opts.one_shot_max_bytes > 0 {
            nccl.one_shot = Some(OneShotGpu::join(gpu, host, opts.one_shot_max_bytes)?);
        }
        let ctx = stream.context().clone();
        let watched = handle.clone();
        let watchdog = Watchdog::start(
            health.clone(),
            move || {
                // Event queries need the device's context on the watchdog's thread.
                let _ = ctx.bind_to_thread();
            },
            move || watched.abort(),
        )
        .map_err(|e| {
            health.fail();
            device(format!("starting the collective watchdog: {e}"))
        })?;
        nccl.watchdog = Some(Arc::new(watchdog));
        Ok(nccl)
    }

    /// Sets what runs before any abort of this communicator (the watchdog's, a failure's, the
    /// drop's): the backend destroys the graphs that captured its collectives.
    pub fn before_abort(&self, release: BeforeAbort) {
        *self
            .handle
            .before_abort
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(release);
    }

    /// Fails when the group is down (a replayed graph's collectives are checked here, as an
    /// enqueued one is before it goes to NCCL).
    pub fn ensure_up(&self) -> Result<(), CommError> {
        match self.health.failed() {
            Some(rank) => Err(CommError::PeerFailed { rank }),
            None => Ok(()),
        }
    }

    /// What a graph that recorded this communicator's collectives reports to after each launch.
    pub fn replay_watch(&self) -> Option<ReplayWatch> {
        self.watchdog.as_ref().map(|w| ReplayWatch {
            rank: self.rank,
            handle: self.handle.clone(),
            stream: self.stream.clone(),
            watchdog: w.clone(),
        })
    }

    /// Whether the stream is being recorded into a graph: a captured collective runs only when
    /// the graph is launched, so there is nothing to watch now (an event recorded in a capture
    /// cannot even be queried).
    fn capturing(&self) -> bool {
        self.stream.capture_status().is_ok_and(|status| {
            status != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
        })
    }

    fn abort_comm(&self) {
        self.handle.abort();
    }

    /// Sums the first `n` values of `data` across the group in place, enqueued on the stream; the
    /// watchdog holds it to the group's deadline, and the step's end reports how it went.
    pub fn all_reduce_bf16(&self, data: &mut CudaSlice<bf16>, n: usize) -> Result<(), CommError> {
        match &self.one_shot {
            Some(o) if n as u64 * 2 <= o.max_bytes() => o.all_reduce_bf16(data, n),
            _ => self.all_reduce_raw(data, n, sys::ncclDataType_t::ncclBfloat16),
        }
    }

    fn all_reduce_raw<T>(
        &self,
        data: &mut CudaSlice<T>,
        n: usize,
        dtype: sys::ncclDataType_t,
    ) -> Result<(), CommError> {
        if n > data.len() {
            return Err(CommError::LengthMismatch {
                rank: self.rank,
                expected: data.len(),
                got: n,
            });
        }
        let stream = self.stream.clone();
        let (ptr, _record) = data.device_ptr_mut(&stream);
        self.enqueue("ncclAllReduce", |comm, s| {
            // SAFETY: `ptr` holds at least `n` values of `dtype` on this communicator's device,
            // in place (send and receive buffers may alias); the stream is the buffer's.
            unsafe {
                result::all_reduce(
                    ptr as *const c_void,
                    ptr as *mut c_void,
                    n,
                    dtype,
                    sys::ncclRedOp_t::ncclSum,
                    comm,
                    s,
                )
            }
        })
    }

    /// Enqueues one NCCL collective (`call`, handed the live communicator and the stream) and
    /// hands it to the watchdog. Fails at once when the group is down or NCCL refuses it.
    fn enqueue(
        &self,
        what: &str,
        call: impl FnOnce(
            sys::ncclComm_t,
            sys::cudaStream_t,
        ) -> Result<result::NcclStatus, result::NcclError>,
    ) -> Result<(), CommError> {
        if let Some(rank) = self.health.failed() {
            self.abort_comm();
            return Err(self.why_down(rank));
        }
        let device = |what: String| CommError::Device {
            rank: self.rank,
            what,
        };
        let stream = self.stream.cu_stream() as sys::cudaStream_t;
        // The communicator is live while `with` holds its lock.
        match self.handle.with(|comm| call(comm, stream)) {
            None => {
                // Aborted by the watchdog, which said why (or by a drop, which cannot be here).
                return Err(match self.health.failed() {
                    Some(rank) => self.why_down(rank),
                    None => {
                        self.health.fail();
                        device("the NCCL communicator was aborted".into())
                    }
                });
            }
            Some(Ok(result::NcclStatus::InProgress)) => {
                // Still being enqueued (non-blocking communicators may say so): nothing else may
                // go to NCCL until it is.
                let h = &self.handle;
                await_collective(&self.health, || h.async_state(), || h.abort())?;
            }
            Some(Ok(_)) => {}
            Some(Err(e)) => {
                self.abort_comm();
                self.health.fail();
                return Err(device(format!("{what}: {}", describe(e.0))));
            }
        }
        if self.capturing() {
            return Ok(());
        }
        let done = self
            .stream
            .record_event(None)
            .map_err(|e| device(format!("recording an event: {e:?}")))?;
        if let Some(w) = &self.watchdog {
            w.watch(Box::new(Enqueued {
                done,
                handle: self.handle.clone(),
            }));
        }
        Ok(())
    }

    /// Why the group is down, `failed` being the rank it was failed in the name of: another
    /// rank's own failure, or this rank's watchdog's verdict (a collective that waited past the
    /// deadline, a device error), not only that it is down.
    fn why_down(&self, failed: usize) -> CommError {
        let verdict = self.watchdog.as_ref().and_then(|w| w.outcome().err());
        match verdict {
            Some(e) if failed == self.rank => e,
            _ => CommError::PeerFailed { rank: failed },
        }
    }

    /// What NCCL's collectives came to: the watchdog's verdict, a peer's failure.
    fn nccl_outcome(&self) -> Result<(), CommError> {
        match (self.health.failed(), &self.watchdog) {
            (Some(rank), _) => Err(self.why_down(rank)),
            (None, Some(w)) => w.outcome(),
            (None, None) => Ok(()),
        }
    }

    /// What the step's collectives came to: NCCL's, and the one-shot kernel's status.
    fn step_outcome(&self) -> Result<(), CommError> {
        self.nccl_outcome()?;
        match &self.one_shot {
            Some(o) => o.check_status(),
            None => Ok(()),
        }
    }

    fn to_device(&self, values: &[f32]) -> Result<CudaSlice<f32>, CommError> {
        self.stream
            .clone_htod(values)
            .map_err(|e| CommError::Device {
                rank: self.rank,
                what: format!("copying to the device: {e:?}"),
            })
    }

    /// Waits for the stream and brings `on_device` back into `out`; then whether NCCL's
    /// collectives went well (the copy waited for them).
    fn to_host_checked(
        &self,
        on_device: &CudaSlice<f32>,
        out: &mut [f32],
    ) -> Result<(), CommError> {
        self.stream
            .memcpy_dtoh(on_device, out)
            .map_err(|e| CommError::Device {
                rank: self.rank,
                what: format!("copying to the host: {e:?}"),
            })?;
        self.nccl_outcome()
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    /// A host slice's sum, through a device copy (f32: the host communicator's contract).
    fn all_reduce_sum(&self, data: &mut [f32]) -> Result<(), CommError> {
        let mut on_device = self.to_device(data)?;
        self.all_reduce_raw(&mut on_device, data.len(), sys::ncclDataType_t::ncclFloat32)?;
        self.to_host_checked(&on_device, data)
    }

    /// Host slices gathered through device copies with `ncclAllGather` (the tensor-parallel LM
    /// head's logits, once a step).
    fn all_gather(&self, local: &[f32], out: &mut [f32]) -> Result<(), CommError> {
        let n = local.len();
        if out.len() != n * self.world {
            return Err(CommError::LengthMismatch {
                rank: self.rank,
                expected: n * self.world,
                got: out.len(),
            });
        }
        let send = self.to_device(local)?;
        let mut recv =
            self.stream
                .alloc_zeros::<f32>(out.len())
                .map_err(|e| CommError::Device {
                    rank: self.rank,
                    what: format!("allocating the gather buffer: {e:?}"),
                })?;
        {
            let stream = self.stream.clone();
            let (from, _read) = send.device_ptr(&stream);
            let (to, _write) = recv.device_ptr_mut(&stream);
            self.enqueue("ncclAllGather", |comm, s| {
                // SAFETY: `from` holds `n` f32 values and `to` world x `n`, both on this
                // communicator's device; the stream is theirs.
                unsafe {
                    result::all_gather(
                        from as *const c_void,
                        to as *mut c_void,
                        n,
                        sys::ncclDataType_t::ncclFloat32,
                        comm,
                        s,
                    )
                }
            })?;
        }
        self.to_host_checked(&recv, out)
    }

    fn abort(&self) {
        self.abort_comm();
        self.health.fail();
    }

    fn device(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn end_step(&self) -> Result<(), CommError> {
        self.step_outcome()
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // Abort rather than finalize: a finalize waits for peers that may be gone.
        self.abort_comm();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The layout NCCL 2.17's header defines: 8-byte size, then four 4-byte fields... and an
    /// 8-aligned pointer at offset 32 (a wrong layout makes NCCL read garbage for `blocking`).
    #[test]
    fn the_config_has_nccl_2_17s_layout() {
        assert_eq!(std::mem::offset_of!(ConfigV217, blocking), 16);
        assert_eq!(std::mem::offset_of!(ConfigV217, max_ctas), 28);
        assert_eq!(std::mem::offset_of!(ConfigV217, net_name), 32);
        assert_eq!(std::mem::offset_of!(ConfigV217, split_share), 40);
        assert_eq!(std::mem::size_of::<ConfigV217>(), 48);
        let c = ConfigV217::non_blocking();
        assert_eq!((c.blocking, c.size, c.version), (0, 48, 21_700));
    }
}
