//! The all-reduce sweep over NCCL, as `kiln doctor` and the lock measure it: one thread per GPU
//! (the layout `kiln serve --tensor-parallel-size` uses), one communicator per rank from a shared
//! unique id, f32 sums in place on each size of [`SWEEP_BYTES`], warm-up calls first, then the
//! mean of timed calls, the slowest rank's.
//!
//! NCCL blocks inside `ncclCommInitRank` and inside collectives when a rank never arrives, so the
//! ranks run on detached threads and the caller waits with a deadline: a rank that fails or hangs
//! turns into an error naming it, and doctor goes on (the process exits afterwards, taking the
//! stuck threads with it).

use std::sync::mpsc;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;
use cudarc::nccl::{Comm, Id, ReduceOp};

use crate::doctor::allreduce::{AllReducePoint, SWEEP_BYTES, slowest_of};

/// Calls before timing (NCCL sets up its channels and protocols lazily) and timed calls per size.
const WARMUP: usize = 5;
const TIMED: usize = 20;

/// Sweeps `ranks` GPUs (ordinals 0..ranks); Err says what failed, in words for doctor.
pub fn nccl_sweep(ranks: usize, deadline: Duration) -> Result<Vec<AllReducePoint>, String> {
    if ranks == 0 {
        return Err("no GPU to sweep".into());
    }
    let report = super::probe()?;
    if report.devices.len() < ranks {
        return Err(format!(
            "{ranks} ranks asked, {} GPUs visible",
            report.devices.len()
        ));
    }
    if report.nccl_version.is_none() {
        return Err("libnccl.so.2 is not loadable".into());
    }
    let id = Id::new().map_err(|e| format!("ncclGetUniqueId failed: {e:?}"))?;
    let start_line = Arc::new(Barrier::new(ranks));
    let (tx, rx) = mpsc::channel();
    for rank in 0..ranks {
        let (tx, start_line) = (tx.clone(), start_line.clone());
        std::thread::Builder::new()
            .name(format!("kiln-nccl-sweep-{rank}"))
            .spawn(move || {
                let result = sweep_rank(rank, ranks, id, &start_line);
                // The receiver may have given up on a deadline; nothing is left to tell.
                let _ = tx.send((rank, result));
            })
            .map_err(|e| format!("spawning rank {rank}: {e}"))?;
    }
    drop(tx);
    let until = Instant::now() + deadline;
    let mut per_rank: Vec<Option<Vec<Duration>>> = vec![None; ranks];
    while per_rank.iter().any(Option::is_none) {
        let left = until.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((rank, Ok(times))) => per_rank[rank] = Some(times),
            Ok((rank, Err(e))) => return Err(format!("rank {rank}: {e}")),
            Err(_) => {
                let missing: Vec<usize> = (0..ranks).filter(|&r| per_rank[r].is_none()).collect();
                return Err(format!(
                    "the sweep did not finish within {deadline:?}: rank(s) {missing:?} never reported (a hung NCCL init or collective; try NCCL_DEBUG=INFO)"
                ));
            }
        }
    }
    let per_rank: Vec<Vec<Duration>> = per_rank.into_iter().flatten().collect();
    Ok(slowest_of(&SWEEP_BYTES, &per_rank, ranks))
}

/// One rank: its context, stream, communicator and buffer; the mean time per call of each size.
fn sweep_rank(
    rank: usize,
    ranks: usize,
    id: Id,
    start_line: &Barrier,
) -> Result<Vec<Duration>, String> {
    let ctx = CudaContext::new(rank).map_err(|e| format!("CUDA context: {e:?}"))?;
    let stream = ctx
        .new_stream()
        .map_err(|e| format!("CUDA stream: {e:?}"))?;
    let comm = Comm::from_rank(stream.clone(), rank, ranks, id)
        .map_err(|e| format!("ncclCommInitRank: {e:?}"))?;
    let largest = SWEEP_BYTES.iter().copied().max().unwrap_or(0) as usize / 4;
    let mut buf = stream
        .alloc_zeros::<f32>(largest)
        .map_err(|e| format!("allocating {} MiB: {e:?}", (largest * 4) >> 20))?;
    let mut out = Vec::with_capacity(SWEEP_BYTES.len());
    for &bytes in &SWEEP_BYTES {
        let mut view = buf.slice_mut(0..bytes as usize / 4);
        let mut call = |n: usize| -> Result<(), String> {
            for _ in 0..n {
                comm.all_reduce_in_place(&mut view, &ReduceOp::Sum)
                    .map_err(|e| format!("ncclAllReduce of {bytes} bytes: {e:?}"))?;
            }
            stream
                .synchronize()
                .map_err(|e| format!("stream synchronize: {e:?}"))
        };
        call(WARMUP)?;
        // Every rank starts the timed calls together, so one rank's late start is not counted
        // as the collective's time.
        start_line.wait();
        let t = Instant::now();
        call(TIMED)?;
        out.push(t.elapsed() / TIMED as u32);
    }
    Ok(out)
}
