//! Waiting on a device collective that may never finish. A GPU collective (NCCL's, or the one-shot
//! kernel) is enqueued and then runs on its own: if a peer died or stalls, the host would wait on
//! the stream forever. So the host polls — the collective's progress, and the group's failure
//! state — and gives up on a deadline, aborting the collective so the GPU is released too (NCCL's
//! fault-tolerance recipe: a non-blocking communicator, `ncclCommGetAsyncError` in a loop,
//! `ncclCommAbort` on timeout). The loop is here, apart from any device, so its failure paths are
//! tested on the CPU.

use std::time::{Duration, Instant};

use super::{CommError, GroupHealth};

/// What one look at a device collective saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Progress {
    Done,
    Pending,
    /// The device or library reported an error, in its words.
    Failed(String),
}

/// How long an eager wait spins before it starts sleeping between polls: a healthy small
/// all-reduce ends within tens of microseconds, and a sleep would cost more than the collective.
const SPIN: Duration = Duration::from_millis(2);
const NAP: Duration = Duration::from_micros(100);

/// How a wait passes the time between polls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pace {
    /// Yield for the first [`SPIN`], then nap: the caller's thread is waiting for the result.
    Eager,
    /// Nap from the start: a background watcher, which must not burn a core.
    Patient,
}

/// Polls until `poll` is done; otherwise says why it never will be: its own failure, a peer's
/// failure, or the group's timeout counted from `start` (when it could first run). No side
/// effects: the caller decides what to abort and whom to tell.
pub fn wait_for(
    health: &GroupHealth,
    start: Instant,
    pace: Pace,
    mut poll: impl FnMut() -> Progress,
) -> Result<(), CommError> {
    let timeout = health.timeout();
    loop {
        match poll() {
            Progress::Done => return Ok(()),
            Progress::Failed(what) => {
                return Err(CommError::Device {
                    rank: health.rank(),
                    what,
                });
            }
            Progress::Pending => {}
        }
        if let Some(rank) = health.failed() {
            return Err(CommError::PeerFailed { rank });
        }
        if start.elapsed() >= timeout {
            return Err(CommError::Timeout {
                waited: timeout,
                // A device collective cannot say which rank is late: every other one may be.
                missing: Vec::new(),
            });
        }
        if pace == Pace::Eager && start.elapsed() < SPIN {
            std::thread::yield_now();
        } else {
            std::thread::sleep(NAP);
        }
    }
}

/// Polls until the collective is done. A peer's failure, the collective's own error or the
/// group's timeout fails the group in this rank's name unless a peer already has, then runs
/// `abort` (which must make the device give the collective up), and returns the matching error.
pub fn await_collective(
    health: &GroupHealth,
    poll: impl FnMut() -> Progress,
    abort: impl FnOnce(),
) -> Result<(), CommError> {
    wait_for(health, Instant::now(), Pace::Eager, poll).inspect_err(|_| {
        health.fail();
        abort();
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::ThreadComm;
    use std::cell::Cell;

    #[test]
    fn a_collective_that_finishes_is_waited_for_and_nothing_is_aborted() {
        let comms = ThreadComm::group(2, Duration::from_secs(10));
        let polls = Cell::new(0);
        let poll = || {
            polls.set(polls.get() + 1);
            if polls.get() < 5 {
                Progress::Pending
            } else {
                Progress::Done
            }
        };
        let r = await_collective(&comms[0].health(), poll, || panic!("must not abort"));
        assert_eq!(r, Ok(()));
        assert_eq!(polls.get(), 5);
        assert_eq!(comms[1].health().failed(), None);
    }

    #[test]
    fn a_collective_that_never_finishes_is_aborted_at_the_deadline() {
        let comms = ThreadComm::group(2, Duration::from_millis(300));
        let aborted = Cell::new(false);
        let t = Instant::now();
        let r = await_collective(
            &comms[0].health(),
            || Progress::Pending,
            || aborted.set(true),
        );
        let waited = t.elapsed();
        assert!(matches!(r, Err(CommError::Timeout { .. })), "{r:?}");
        assert!(aborted.get(), "the device collective must be aborted");
        assert!(waited >= Duration::from_millis(300), "{waited:?}");
        assert!(waited < Duration::from_secs(5), "{waited:?}");
        // The other rank's next collective fails at once instead of waiting its own deadline.
        assert_eq!(comms[1].health().failed(), Some(0));
    }

    #[test]
    fn a_dead_peer_aborts_the_wait_well_before_the_deadline() {
        let comms = ThreadComm::group(3, Duration::from_secs(60));
        let peer = comms[2].health();
        let dying = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            peer.fail();
        });
        let aborted = Cell::new(false);
        let t = Instant::now();
        let r = await_collective(
            &comms[0].health(),
            || Progress::Pending,
            || aborted.set(true),
        );
        dying.join().expect("peer thread");
        assert_eq!(r, Err(CommError::PeerFailed { rank: 2 }));
        assert!(aborted.get());
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    }

    #[test]
    fn a_device_error_aborts_and_names_the_rank() {
        let comms = ThreadComm::group(2, Duration::from_secs(60));
        let aborted = Cell::new(false);
        let r = await_collective(
            &comms[1].health(),
            || Progress::Failed("ncclRemoteError".into()),
            || aborted.set(true),
        );
        assert_eq!(
            r,
            Err(CommError::Device {
                rank: 1,
                what: "ncclRemoteError".into()
            })
        );
        assert!(aborted.get());
        assert_eq!(comms[0].health().failed(), Some(1));
    }
}
