//! The one-shot all-reduce on GPUs: `kernels/allreduce.cu` run over PCIe peer-to-peer, the host
//! side of the protocol `parallel::oneshot` tests over CPU ranks. Each rank allocates its inbox on
//! its own GPU; the ranks (threads of one process) exchange the inboxes' addresses and their
//! contexts over the host group, enable peer access to every other GPU, and from then on every
//! call is one kernel launch per rank that pushes its values into every inbox, raises its flag,
//! waits for the others' flags and sums in rank order.
//!
//! Neither side can hang: the kernel gives up after the group's timeout in clock cycles and
//! writes which sender it waited for; the host does not wait on each launch but reads that status
//! once a step, after its own synchronization ([`OneShotGpu::check_status`]).
//!
//! On one GPU this is a one-rank identity and proves nothing; its worth (and the size up to which
//! it beats NCCL) is measured on a multi-GPU host by [`one_shot_sweep`], which `kiln doctor` and
//! `kiln lock` run.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg, sys,
};
use half::bf16;

use super::gpu::Gpu;
use crate::doctor::allreduce::{AllReducePoint, ONE_SHOT_SWEEP_MAX, SWEEP_BYTES, slowest_of};
use crate::parallel::{CommError, Communicator, GroupHealth, ThreadComm};

/// Threads of the one block each rank launches: enough to keep a PCIe link busy with stores.
const BLOCK: u32 = 512;

/// One rank's end of the one-shot all-reduce.
pub struct OneShotGpu {
    rank: usize,
    world: usize,
    /// bf16 values per slot (a multiple of 4, so the flags after the slots are 8-byte aligned).
    capacity: usize,
    /// This rank's inbox; the peers write into it.
    _inbox: CudaSlice<u8>,
    /// Every rank's inbox address, for the kernel.
    table: CudaSlice<u64>,
    /// 0, or 1 + the sender a timed-out launch waited for.
    status: CudaSlice<i32>,
    /// The last call's number, on the device (0: none yet; flags start at 0 too). The kernel
    /// counts its own calls, so a launch recorded into a CUDA graph numbers its replays.
    calls: CudaSlice<u64>,
    deadline_cycles: i64,
    stream: Arc<CudaStream>,
    kernel: CudaFunction,
    health: GroupHealth,
}

// SAFETY: the rank's thread makes every call; the slices and function are cudarc's (Send + Sync).
unsafe impl Send for OneShotGpu {}
unsafe impl Sync for OneShotGpu {}

fn device_err(rank: usize) -> impl Fn(String) -> CommError {
    move |what| CommError::Device { rank, what }
}

impl OneShotGpu {
    /// Sets up the group's inboxes for messages of up to `max_bytes`. Every rank calls it at once.
    pub fn join(gpu: &Gpu, host: &ThreadComm, max_bytes: u64) -> Result<OneShotGpu, CommError> {
        let (rank, world, health) = (host.rank(), host.world(), host.health());
        let failed = |e: CommError| {
            health.fail();
            e
        };
        let err = device_err(rank);
        let capacity = (max_bytes as usize).div_ceil(2).next_multiple_of(4);
        let stream = gpu.stream.clone();
        let kernel = gpu
            .f("kiln_oneshot_allreduce_bf16")
            .map_err(&err)
            .map_err(failed)?
            .clone();
        let bytes = 2 * world * capacity * 2 + world * 8;
        let inbox = stream
            .alloc_zeros::<u8>(bytes)
            .map_err(|e| failed(err(format!("allocating the inbox ({bytes} bytes): {e:?}"))))?;
        let (address, _) = inbox.device_ptr(&stream);
        let addresses = host.all_gather_u64(address)?;
        let contexts = host.all_gather_u64(gpu.ctx.cu_ctx() as u64)?;
        let devices = host.all_gather_u64(gpu.ctx.cu_device() as u64)?;
        gpu.ctx
            .bind_to_thread()
            .map_err(|e| failed(err(format!("binding the CUDA context: {e:?}"))))?;
        // Ranks on the same GPU (the device check's several ranks per GPU) need no peer access.
        for peer in (0..world).filter(|&p| devices[p] != devices[rank]) {
            let mut can = 0;
            // SAFETY: both are devices of this process's driver; `can` outlives the call.
            let r = unsafe {
                sys::cuDeviceCanAccessPeer(
                    &mut can,
                    gpu.ctx.cu_device(),
                    devices[peer] as sys::CUdevice,
                )
            };
            if r != sys::CUresult::CUDA_SUCCESS || can == 0 {
                return Err(failed(err(format!(
                    "GPU {rank} cannot write GPU {peer}'s memory peer-to-peer ({r:?}); check \
                     `nvidia-smi topo -p2p w`, ACS and the IOMMU (iommu=pt), or serve with \
                     --one-shot-allreduce-max-bytes 0"
                ))));
            }
            // SAFETY: the peer's context is live for the group's life (its rank holds it).
            let r = unsafe { sys::cuCtxEnablePeerAccess(contexts[peer] as sys::CUcontext, 0) };
            if !matches!(
                r,
                sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
            ) {
                return Err(failed(err(format!(
                    "enabling peer access from GPU {rank} to GPU {peer}: {r:?}"
                ))));
            }
        }
        let table = stream
            .clone_htod(&addresses)
            .map_err(|e| failed(err(format!("copying the inbox table: {e:?}"))))?;
        let status = stream
            .alloc_zeros::<i32>(1)
            .map_err(|e| failed(err(format!("allocating the status word: {e:?}"))))?;
        let calls = stream
            .alloc_zeros::<u64>(1)
            .map_err(|e| failed(err(format!("allocating the call counter: {e:?}"))))?;
        let clock_khz = gpu
            .ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CLOCK_RATE)
            .map_err(|e| failed(err(format!("reading the clock rate: {e:?}"))))?;
        let deadline_cycles =
            (health.timeout().as_secs_f64() * f64::from(clock_khz) * 1e3).min(i64::MAX as f64);
        Ok(OneShotGpu {
            rank,
            world,
            capacity,
            _inbox: inbox,
            table,
            status,
            calls,
            deadline_cycles: deadline_cycles as i64,
            stream,
            kernel,
            health,
        })
    }

    /// The largest message it takes, in bytes.
    pub fn max_bytes(&self) -> u64 {
        self.capacity as u64 * 2
    }

    /// Sums the first `n` values of `data` across the group in place, enqueued on the stream
    /// ([`OneShotGpu::check_status`] says afterwards whether every peer arrived in time).
    pub fn all_reduce_bf16(&self, data: &mut CudaSlice<bf16>, n: usize) -> Result<(), CommError> {
        let err = device_err(self.rank);
        if let Some(rank) = self.health.failed() {
            return Err(CommError::PeerFailed { rank });
        }
        if n > self.capacity || n > data.len() {
            return Err(CommError::LengthMismatch {
                rank: self.rank,
                expected: self.capacity.min(data.len()),
                got: n,
            });
        }
        let stream = self.stream.clone();
        {
            let (x, _record) = data.device_ptr_mut(&stream);
            let (world, rank) = (self.world as i32, self.rank as i32);
            let (capacity, count) = (self.capacity as i64, n as i64);
            // The kernel writes the status word and its call counter through their addresses.
            let (status, _status_record) = self.status.device_ptr(&stream);
            let (calls, _calls_record) = self.calls.device_ptr(&stream);
            let mut b = stream.launch_builder(&self.kernel);
            // In place: every thread has pushed its share of `x` before the block's barrier, and
            // the sums are written only after it.
            b.arg(&self.table)
                .arg(&world)
                .arg(&rank)
                .arg(&capacity)
                .arg(&x)
                .arg(&count)
                .arg(&calls)
                .arg(&self.deadline_cycles)
                .arg(&x)
                .arg(&status);
            let cfg = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the arguments match the kernel's signature; `x` holds `n` values, the table
            // the world's inbox addresses (peer access enabled), each inbox `capacity` per slot.
            unsafe { b.launch(cfg) }.map_err(|e| err(format!("launching: {e:?}")))?;
        }
        Ok(())
    }

    /// Whether every launch so far met its peers: the kernel ends on its own deadline and writes
    /// the sender it waited for. Reads the status word (a copy that waits for the stream), so the
    /// rank calls it once a step, after it has synchronized anyway.
    pub fn check_status(&self) -> Result<(), CommError> {
        let status = self
            .stream
            .clone_dtoh(&self.status)
            .map_err(|e| device_err(self.rank)(format!("reading the status: {e:?}")))?;
        match status.first().copied().unwrap_or(0) {
            0 => Ok(()),
            late => {
                self.health.fail();
                Err(CommError::Timeout {
                    waited: self.health.timeout(),
                    missing: vec![(late - 1) as usize],
                })
            }
        }
    }
}

/// Calls before timing and timed calls per size, as the NCCL sweep does.
const WARMUP: usize = 5;
const TIMED: usize = 20;

/// The one-shot kernel's sweep over `ranks` GPUs, at the sweep sizes up to
/// [`ONE_SHOT_SWEEP_MAX`]; Err says what failed, in words for doctor.
pub fn one_shot_sweep(ranks: usize, deadline: Duration) -> Result<Vec<AllReducePoint>, String> {
    if ranks < 2 {
        return Err("the one-shot all-reduce needs 2 or more GPUs".into());
    }
    let sizes: Vec<u64> = SWEEP_BYTES
        .iter()
        .copied()
        .filter(|&b| b <= ONE_SHOT_SWEEP_MAX)
        .collect();
    let comms = ThreadComm::group(ranks, deadline);
    let per_rank: Vec<Result<Vec<Duration>, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let sizes = &sizes;
                scope.spawn(move || sweep_rank(&comm, sizes))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a sweep thread panicked".into()))
            })
            .collect()
    });
    let mut times = Vec::new();
    for (rank, r) in per_rank.into_iter().enumerate() {
        times.push(r.map_err(|e| format!("rank {rank}: {e}"))?);
    }
    Ok(slowest_of(&sizes, &times, ranks))
}

/// The visible GPU rank `rank` runs on: its own where there are enough, else shared round-robin
/// (the device check runs several ranks on one GPU).
fn ordinal_of(rank: usize) -> Result<usize, String> {
    let gpus = super::probe()?.devices.len();
    if gpus == 0 {
        return Err("no CUDA device".into());
    }
    Ok(rank % gpus)
}

fn sweep_rank(comm: &ThreadComm, sizes: &[u64]) -> Result<Vec<Duration>, String> {
    let fail = |e: String| {
        comm.health().fail();
        e
    };
    let gpu = ordinal_of(comm.rank()).and_then(Gpu::open).map_err(fail)?;
    let largest = sizes.iter().copied().max().unwrap_or(0);
    let one_shot = OneShotGpu::join(&gpu, comm, largest).map_err(|e| e.to_string())?;
    let mut buf = gpu
        .stream
        .alloc_zeros::<bf16>(largest as usize / 2)
        .map_err(|e| fail(format!("allocating the buffer: {e:?}")))?;
    let mut out = Vec::with_capacity(sizes.len());
    for &bytes in sizes {
        let n = bytes as usize / 2;
        let mut call = |times: usize| -> Result<(), String> {
            for _ in 0..times {
                one_shot
                    .all_reduce_bf16(&mut buf, n)
                    .map_err(|e| format!("{bytes} bytes: {e}"))?;
            }
            Ok(())
        };
        call(WARMUP)?;
        gpu.stream
            .synchronize()
            .map_err(|e| fail(format!("stream synchronize: {e:?}")))?;
        // Lines the ranks up, so one rank's late start is not counted as the collective's time.
        let mut line = [0f32];
        comm.all_reduce_sum(&mut line).map_err(|e| e.to_string())?;
        let t = Instant::now();
        call(TIMED)?;
        gpu.stream
            .synchronize()
            .map_err(|e| fail(format!("stream synchronize: {e:?}")))?;
        out.push(t.elapsed() / TIMED as u32);
        one_shot.check_status().map_err(|e| e.to_string())?;
    }
    Ok(out)
}

/// The protocol on real GPUs: `ranks` ranks (several per GPU when there are fewer GPUs; on one
/// GPU their launches run side by side on its SMs, through system-scope flags as over PCIe), each
/// summing `calls` messages of varying length filled from `seed`, checked bit for bit against the
/// rank-ordered f32 sum rounded to bf16 that every rank must produce. Returns a line for the
/// device check; Err names the first wrong value.
pub fn one_shot_selftest(ranks: usize, calls: usize, seed: u64) -> Result<String, String> {
    let comms = ThreadComm::group(ranks, Duration::from_secs(60));
    let max_n = 8192usize;
    // Message lengths and values every rank derives from the seed alone.
    let length = |call: usize| 1 + (seed as usize).wrapping_add(call * 7919) % max_n;
    let value = |rank: usize, call: usize, i: usize| -> bf16 {
        let h = (seed ^ (rank as u64) << 40 ^ (call as u64) << 20 ^ i as u64)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15);
        bf16::from_f32(((h >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0)
    };
    let t = Instant::now();
    let results: Vec<Result<(), String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                scope.spawn(move || -> Result<(), String> {
                    let rank = comm.rank();
                    let fail = |e: String| {
                        comm.health().fail();
                        e
                    };
                    let gpu = ordinal_of(rank).and_then(Gpu::open).map_err(fail)?;
                    let one_shot = OneShotGpu::join(&gpu, &comm, max_n as u64 * 2)
                        .map_err(|e| e.to_string())?;
                    // One buffer for every call: freeing device memory waits for all of the
                    // GPU's work, so with several ranks on one GPU a rank freeing between calls
                    // would wait on a peer's kernel that waits for this rank's next launch.
                    let mut buf = gpu
                        .stream
                        .alloc_zeros::<bf16>(max_n)
                        .map_err(|e| fail(format!("allocating the buffer: {e:?}")))?;
                    for call in 0..calls {
                        let n = length(call);
                        let mine: Vec<bf16> = (0..n).map(|i| value(rank, call, i)).collect();
                        gpu.stream
                            .memcpy_htod(&mine, &mut buf)
                            .map_err(|e| fail(format!("upload: {e:?}")))?;
                        one_shot
                            .all_reduce_bf16(&mut buf, n)
                            .map_err(|e| format!("call {call}: {e}"))?;
                        let mut got = vec![bf16::ZERO; n];
                        gpu.stream
                            .memcpy_dtoh(&buf.slice(0..n), &mut got)
                            .map_err(|e| fail(format!("download: {e:?}")))?;
                        one_shot
                            .check_status()
                            .map_err(|e| format!("call {call}: {e}"))?;
                        for (i, g) in got.iter().enumerate() {
                            let sum = (0..ranks).fold(0f32, |s, r| s + value(r, call, i).to_f32());
                            if g.to_bits() != bf16::from_f32(sum).to_bits() {
                                return Err(fail(format!(
                                    "call {call} (n {n}), value {i}: {g} where the rank-ordered sum is {sum}"
                                )));
                            }
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a rank thread panicked".into()))
            })
            .collect()
    });
    for (rank, r) in results.into_iter().enumerate() {
        r.map_err(|e| format!("rank {rank}: {e}"))?;
    }
    Ok(format!(
        "one-shot all-reduce: {ranks} ranks x {calls} calls of 1..{max_n} values, every sum bit-exact ({:.1} s)",
        t.elapsed().as_secs_f64()
    ))
}
