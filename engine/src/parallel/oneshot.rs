//! The one-shot all-reduce for small messages: the protocol kiln's peer-to-peer GPU kernel runs
//! over PCIe, here over memory shared by CPU rank threads, where its layout, flags and barrier
//! are tested. On eight PCIe GPUs a small all-reduce costs NCCL ~25-50 us and one pass of this
//! protocol ~6-9 us; Kimi-K2 does 122 a token.
//!
//! Every rank owns an inbox: two slot sets (by call parity) of one slot per sending rank, and one
//! flag per sending rank holding the last call that rank finished writing. Call `e` of rank `r`:
//! 1. **Push** (never pull: reads of a peer's memory over PCIe peer-to-peer are the slow, hang-
//!    prone direction): write its values and their count into slot `r` of set `e % 2` in every
//!    rank's inbox, then raise its flag there to `e` (a release store after the data).
//! 2. **Wait** (acquire loads) until every flag in its own inbox is at least `e`, against a
//!    deadline and the group's failure mark.
//! 3. **Sum** the slots in rank order, so every rank gets bit-identical values.
//!
//! The closing barrier is the parity. Set `e % 2` is written again only by call `e + 2`; a rank
//! reaches that push only after finishing call `e + 1`, which needed every rank's flag for
//! `e + 1`, which a rank raises only after it finished reading call `e`. So no slot is
//! overwritten while a slow rank still reads it. A single set would need an explicit barrier at
//! the end of each call: a fused kernel without one corrupts the next call's inputs.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::{CommError, Communicator};

/// No rank has failed.
const NONE_FAILED: usize = usize::MAX;

/// One rank's inbox: `2 x world` slots of `capacity` values (f32 bits), a count per slot, and a
/// flag per sending rank.
struct Inbox {
    values: Vec<AtomicU32>,
    counts: Vec<AtomicUsize>,
    flags: Vec<AtomicU64>,
}

impl Inbox {
    fn new(world: usize, capacity: usize) -> Inbox {
        Inbox {
            values: (0..2 * world * capacity)
                .map(|_| AtomicU32::new(0))
                .collect(),
            counts: (0..2 * world).map(|_| AtomicUsize::new(0)).collect(),
            flags: (0..world).map(|_| AtomicU64::new(0)).collect(),
        }
    }
}

struct Group {
    world: usize,
    /// Values per slot: the largest message this path takes.
    capacity: usize,
    inboxes: Vec<Inbox>,
    failed: AtomicUsize,
    /// Ranks whose handle is gone: a call still waiting for one of them can never complete.
    departed: Vec<AtomicBool>,
    timeout: Duration,
}

/// One rank's handle. Once it is dropped, a rank still waiting for its push fails instead of
/// waiting out the deadline; dropping it while unwinding from a panic fails the group at once.
/// (There is no closing barrier, so a rank may finish its last call and leave while others
/// still read theirs: leaving alone is not a failure.)
pub struct OneShotComm {
    rank: usize,
    group: Arc<Group>,
    /// The next call's number (from 1: a flag of 0 is "nothing yet").
    call: AtomicU64,
}

impl OneShotComm {
    /// A group of `world` handles for messages of up to `capacity` values; a collective that
    /// waits longer than `timeout` for the others fails the group.
    pub fn group(world: usize, capacity: usize, timeout: Duration) -> Vec<OneShotComm> {
        assert!(world > 0, "a tensor-parallel group needs at least one rank");
        let group = Arc::new(Group {
            world,
            capacity,
            inboxes: (0..world).map(|_| Inbox::new(world, capacity)).collect(),
            failed: AtomicUsize::new(NONE_FAILED),
            departed: (0..world).map(|_| AtomicBool::new(false)).collect(),
            timeout,
        });
        (0..world)
            .map(|rank| OneShotComm {
                rank,
                group: group.clone(),
                call: AtomicU64::new(1),
            })
            .collect()
    }

    /// Values per slot: messages up to this size take this path.
    pub fn capacity(&self) -> usize {
        self.group.capacity
    }

    fn peer_failed(&self) -> Option<CommError> {
        match self.group.failed.load(Ordering::Acquire) {
            NONE_FAILED => None,
            rank => Some(CommError::PeerFailed { rank }),
        }
    }

    /// Pushes `local` to every inbox and waits for every rank's push of this call; then `read`
    /// sees the slot set, sender by sender.
    fn exchange(
        &self,
        local: &[f32],
        mut read: impl FnMut(usize, &[AtomicU32]),
    ) -> Result<(), CommError> {
        let g = &*self.group;
        if let Some(e) = self.peer_failed() {
            return Err(e);
        }
        if local.len() > g.capacity {
            // Every rank of a sharded forward calls with the same length, so all take this
            // branch together; the caller routes such messages elsewhere.
            return Err(CommError::LengthMismatch {
                rank: self.rank,
                expected: g.capacity,
                got: local.len(),
            });
        }
        let call = self.call.fetch_add(1, Ordering::Relaxed);
        let set = (call % 2) as usize;
        let slot = |sender: usize| set * g.world + sender;
        // 1. Push: the values, their count, then the flag (release: the data is visible to
        // whoever sees the flag).
        for inbox in &g.inboxes {
            let at = slot(self.rank) * g.capacity;
            for (cell, v) in inbox.values[at..at + local.len()].iter().zip(local) {
                cell.store(v.to_bits(), Ordering::Relaxed);
            }
            inbox.counts[slot(self.rank)].store(local.len(), Ordering::Relaxed);
            inbox.flags[self.rank].store(call, Ordering::Release);
        }
        // 2. Wait for every sender's flag in this rank's inbox.
        let inbox = &g.inboxes[self.rank];
        let start = Instant::now();
        let mut spins = 0u32;
        while (0..g.world).any(|s| inbox.flags[s].load(Ordering::Acquire) < call) {
            // Spin briefly (the GPU kernel spins outright), then yield the core and check the
            // ways this call can never complete.
            spins += 1;
            if spins < 256 {
                std::hint::spin_loop();
                continue;
            }
            std::thread::yield_now();
            if let Some(e) = self.peer_failed() {
                return Err(e);
            }
            let missing: Vec<usize> = (0..g.world)
                .filter(|&s| inbox.flags[s].load(Ordering::Acquire) < call)
                .collect();
            // Departed first, then its flag again: a rank that pushed and then left has its
            // flag visible once its departure is.
            if let Some(&gone) = missing.iter().find(|&&s| {
                g.departed[s].load(Ordering::Acquire)
                    && inbox.flags[s].load(Ordering::Acquire) < call
            }) {
                self.fail();
                return Err(CommError::PeerFailed { rank: gone });
            }
            if start.elapsed() >= g.timeout {
                self.fail();
                return Err(CommError::Timeout {
                    waited: g.timeout,
                    missing,
                });
            }
        }
        // 3. Read in rank order.
        for sender in 0..g.world {
            let got = inbox.counts[slot(sender)].load(Ordering::Relaxed);
            if got != local.len() {
                self.fail();
                return Err(CommError::LengthMismatch {
                    rank: sender,
                    expected: local.len(),
                    got,
                });
            }
            let at = slot(sender) * g.capacity;
            read(sender, &inbox.values[at..at + got]);
        }
        Ok(())
    }

    fn fail(&self) {
        let _ = self.group.failed.compare_exchange(
            NONE_FAILED,
            self.rank,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }
}

impl Communicator for OneShotComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.group.world
    }

    fn all_reduce_sum(&self, data: &mut [f32]) -> Result<(), CommError> {
        let local = data.to_vec();
        let mut sum = vec![0f32; data.len()];
        self.exchange(&local, |_, values| {
            for (s, v) in sum.iter_mut().zip(values) {
                *s += f32::from_bits(v.load(Ordering::Relaxed));
            }
        })?;
        data.copy_from_slice(&sum);
        Ok(())
    }

    fn all_gather(&self, local: &[f32], out: &mut [f32]) -> Result<(), CommError> {
        let n = local.len();
        if out.len() != n * self.group.world {
            return Err(CommError::LengthMismatch {
                rank: self.rank,
                expected: n * self.group.world,
                got: out.len(),
            });
        }
        self.exchange(local, |sender, values| {
            for (o, v) in out[sender * n..(sender + 1) * n].iter_mut().zip(values) {
                *o = f32::from_bits(v.load(Ordering::Relaxed));
            }
        })
    }

    fn abort(&self) {
        self.fail();
    }
}

impl Drop for OneShotComm {
    fn drop(&mut self) {
        self.group.departed[self.rank].store(true, Ordering::Release);
        if std::thread::panicking() {
            self.fail();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn run<T: Send + 'static>(
        comms: Vec<OneShotComm>,
        f: impl Fn(OneShotComm) -> T + Send + Sync + 'static,
    ) -> Vec<std::thread::Result<T>> {
        let f = Arc::new(f);
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let f = f.clone();
                std::thread::spawn(move || f(c))
            })
            .collect();
        handles.into_iter().map(|h| h.join()).collect()
    }

    #[test]
    fn ranks_at_different_speeds_get_exact_rank_ordered_sums_every_call() {
        // Ranks sleep at random between calls, so a fast rank pushes call e + 1 while a slow
        // one still reads call e: the parity sets must keep every call's inputs intact.
        for world in [2, 4, 8] {
            let results = run(
                OneShotComm::group(world, 64, Duration::from_secs(20)),
                move |c| {
                    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(c.rank() as u64);
                    let mut out = Vec::new();
                    for call in 0..300usize {
                        let len = 1 + call % 64;
                        let mut data: Vec<f32> = (0..len)
                            .map(|i| ((c.rank() + 1) * 1000 + call * 7 + i) as f32 * 0.125)
                            .collect();
                        if rng.random_range(0..4) == 0 {
                            std::thread::sleep(Duration::from_micros(rng.random_range(0..300)));
                        }
                        c.all_reduce_sum(&mut data).expect("all-reduce");
                        out.push(data);
                    }
                    out
                },
            );
            let per_rank: Vec<Vec<Vec<f32>>> =
                results.into_iter().map(|r| r.expect("rank")).collect();
            for call in 0..300usize {
                let len = 1 + call % 64;
                let want: Vec<f32> = (0..len)
                    .map(|i| {
                        (0..world).fold(0f32, |acc, r| {
                            acc + ((r + 1) * 1000 + call * 7 + i) as f32 * 0.125
                        })
                    })
                    .collect();
                for (r, calls) in per_rank.iter().enumerate() {
                    assert_eq!(calls[call], want, "world {world}, rank {r}, call {call}");
                }
            }
        }
    }

    #[test]
    fn all_gather_concatenates_in_rank_order() {
        let results = run(OneShotComm::group(4, 8, Duration::from_secs(10)), |c| {
            let local = vec![c.rank() as f32; 3];
            let mut out = vec![0f32; 12];
            c.all_gather(&local, &mut out).expect("gather");
            out
        });
        let want: Vec<f32> = (0..4).flat_map(|r| [r as f32; 3]).collect();
        for r in results {
            assert_eq!(r.expect("rank"), want);
        }
    }

    #[test]
    fn a_panicking_rank_fails_the_others_instead_of_hanging() {
        let results = run(OneShotComm::group(4, 8, Duration::from_secs(30)), |c| {
            if c.rank() == 2 {
                panic!("rank 2 dies before its first collective");
            }
            let mut data = vec![1.0; 4];
            c.all_reduce_sum(&mut data)
        });
        let start = Instant::now();
        for (r, res) in results.into_iter().enumerate() {
            match (r, res) {
                (2, res) => assert!(res.is_err(), "rank 2 panicked"),
                (_, Ok(Err(CommError::PeerFailed { rank: 2 }))) => {}
                (r, other) => panic!("rank {r}: {other:?}"),
            }
        }
        assert!(start.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn a_stalled_rank_times_out_the_group_within_its_deadline() {
        let timeout = Duration::from_millis(300);
        let started = Instant::now();
        let results = run(OneShotComm::group(3, 8, timeout), move |c| {
            if c.rank() == 1 {
                std::thread::sleep(Duration::from_secs(2));
                return Ok(());
            }
            let mut data = vec![1.0; 4];
            c.all_reduce_sum(&mut data)
        });
        for (r, res) in results.into_iter().enumerate() {
            match (r, res.expect("no panic")) {
                (1, _) => {}
                (_, Err(CommError::Timeout { missing, .. })) => assert_eq!(missing, vec![1]),
                (_, Err(CommError::PeerFailed { .. })) => {}
                (r, other) => panic!("rank {r}: {other:?}"),
            }
        }
        // The waiting ranks returned at their deadline, not when the stalled one woke.
        assert!(started.elapsed() < Duration::from_secs(2) + timeout);
    }

    #[test]
    fn mismatched_or_oversized_messages_are_errors_not_garbage() {
        let results = run(OneShotComm::group(2, 8, Duration::from_secs(10)), |c| {
            let mut data = vec![1.0; 2 + c.rank()];
            c.all_reduce_sum(&mut data)
        });
        // The rank that reads the other's count first reports the mismatch; the other may see
        // the group already failed by then.
        let errors: Vec<CommError> = results
            .into_iter()
            .map(|r| r.expect("no panic").expect_err("refused"))
            .collect();
        assert!(
            errors
                .iter()
                .any(|e| matches!(e, CommError::LengthMismatch { .. })),
            "{errors:?}"
        );
        assert!(errors.iter().all(|e| matches!(
            e,
            CommError::LengthMismatch { .. } | CommError::PeerFailed { .. }
        )));
        let comms = OneShotComm::group(1, 4, Duration::from_secs(1));
        let mut big = vec![0.0; 5];
        assert!(matches!(
            comms[0].all_reduce_sum(&mut big),
            Err(CommError::LengthMismatch {
                expected: 4,
                got: 5,
                ..
            })
        ));
    }
}
