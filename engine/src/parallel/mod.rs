//! Tensor parallelism's collective operations behind one trait, so the sharded model runs the same
//! code over threads in one process (the CPU, and the tests) and over NCCL between GPUs.
//!
//! The failure rule: a rank that dies (panics, returns an error, is dropped) makes every other
//! rank's next or pending collective return [`CommError::PeerFailed`] instead of waiting forever, so
//! a failing rank takes the whole group down cleanly rather than hanging the server.

mod deadline;
mod oneshot;
mod peers;
mod shard;
mod threads;
pub mod tp;
mod watchdog;

pub use deadline::{Progress, await_collective};
pub use oneshot::OneShotComm;
pub use peers::{PeerConfig, TpGroup, TpPeers};
pub use shard::{MoeSplit, Shard, ShardPlan};
pub use threads::{GroupHealth, ThreadComm};
pub use watchdog::{Completion, Watchdog};

use std::time::Duration;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CommError {
    #[error("tensor-parallel rank {rank} failed; the group is down")]
    PeerFailed { rank: usize },
    #[error(
        "a collective waited {waited:?} for the other ranks{}",
        missing_ranks(missing)
    )]
    Timeout {
        waited: Duration,
        missing: Vec<usize>,
    },
    #[error("tensor-parallel rank {rank}'s device collective failed: {what}")]
    Device { rank: usize, what: String },
    #[error("the tensor-parallel group is down: {0}")]
    GroupDown(String),
    #[error("rank {rank} passed {got} values to a collective the others called with {expected}")]
    LengthMismatch {
        rank: usize,
        expected: usize,
        got: usize,
    },
}

/// The ranks a timed-out collective waited for, when it knows them (NCCL does not say).
fn missing_ranks(missing: &[usize]) -> String {
    if missing.is_empty() {
        String::new()
    } else {
        format!(" (rank(s) {missing:?} never arrived)")
    }
}

/// How a group's device collectives are set up (from `kiln serve`'s flags, or the lock).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GroupOptions {
    /// All-reduces of at most this many bytes run on the one-shot peer-to-peer kernel, larger
    /// ones on NCCL; 0: NCCL only. `kiln lock` measures both and records the crossover.
    pub one_shot_max_bytes: u64,
}

/// Collectives over one group of `world()` ranks. Every rank calls the same collectives in the
/// same order with the same lengths (the sharded forward pass is identical code on every rank).
pub trait Communicator: Send {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// Element-wise sum across ranks, in place; afterwards every rank holds the same values.
    fn all_reduce_sum(&self, data: &mut [f32]) -> Result<(), CommError>;
    /// Concatenates every rank's `local` in rank order into `out` (`out.len() == world * local.len()`).
    fn all_gather(&self, local: &[f32], out: &mut [f32]) -> Result<(), CommError>;
    /// Marks this rank failed: the others' collectives return `PeerFailed` from now on.
    fn abort(&self);
    /// The device-side communicator behind this one, for a backend that sums its own buffers
    /// where they live (CUDA: NCCL on device memory) and downcasts to its own type; `None` for a
    /// host communicator, whose sums go through host copies.
    fn device(&self) -> Option<&dyn std::any::Any> {
        None
    }
    /// Called by each rank at the end of its step, once it has synchronized with its device
    /// (its logits are on the host): a device communicator whose collectives run unwatched by the
    /// rank's thread reports here what its watchdog saw. Host communicators fail in the call.
    fn end_step(&self) -> Result<(), CommError> {
        Ok(())
    }
}
