//! The CPU communicator: the ranks are threads of one process sharing a rendezvous. Each
//! collective is two phases — every rank deposits its buffer, then every rank reads all of them —
//! separated by generation-counted barriers, so the buffers can be reused by the next collective.
//! Sums run in rank order on every rank, so all ranks get bit-identical results (what a sharded
//! greedy decode needs to pick the same token everywhere).

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{CommError, Communicator};

struct State {
    /// Each rank's deposited values for the collective in flight.
    slots: Vec<Vec<f32>>,
    /// Ranks that have arrived at the current barrier.
    arrived: Vec<bool>,
    /// Bumped each time a barrier opens; a waiter leaves when it changes.
    generation: u64,
    failed: Option<usize>,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    timeout: Duration,
}

/// One rank's handle. Dropping it (including by unwinding from a panic) fails the group.
pub struct ThreadComm {
    rank: usize,
    world: usize,
    shared: Arc<Shared>,
}

impl ThreadComm {
    /// A group of `world` handles, one per rank thread; a collective that waits longer than
    /// `timeout` for the others fails (a stuck rank must not hang the server).
    pub fn group(world: usize, timeout: Duration) -> Vec<ThreadComm> {
        assert!(world > 0, "a tensor-parallel group needs at least one rank");
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                slots: vec![Vec::new(); world],
                arrived: vec![false; world],
                generation: 0,
                failed: None,
            }),
            changed: Condvar::new(),
            timeout,
        });
        (0..world)
            .map(|rank| ThreadComm {
                rank,
                world,
                shared: shared.clone(),
            })
            .collect()
    }

    /// A handle on the group's failure state that outlives this borrow (a device communicator
    /// polls it while it waits on its GPU).
    pub fn health(&self) -> GroupHealth {
        GroupHealth {
            rank: self.rank,
            shared: self.shared.clone(),
        }
    }

    /// Copies `root`'s `bytes` into every rank's `bytes` (equal lengths on every rank). How a
    /// device communicator shares its rendezvous token (NCCL's unique id) across the group.
    pub fn broadcast_bytes(&self, root: usize, bytes: &mut [u8]) -> Result<(), CommError> {
        if root >= self.world {
            return Err(CommError::PeerFailed { rank: root });
        }
        // Bytes travel as f32 values, which hold 0..=255 exactly.
        let local: Vec<f32> = bytes.iter().map(|&b| f32::from(b)).collect();
        let mut all = vec![0f32; local.len() * self.world];
        self.all_gather(&local, &mut all)?;
        let theirs = &all[root * local.len()..(root + 1) * local.len()];
        for (b, &v) in bytes.iter_mut().zip(theirs) {
            *b = v as u8;
        }
        Ok(())
    }

    /// Every rank's `value`, in rank order. How device communicators exchange addresses (a
    /// rank's buffer on its GPU, its context) within one process.
    pub fn all_gather_u64(&self, value: u64) -> Result<Vec<u64>, CommError> {
        // Four 16-bit pieces per value, each exact as an f32.
        let local: Vec<f32> = (0..4)
            .map(|i| ((value >> (16 * i)) & 0xffff) as f32)
            .collect();
        let mut all = vec![0f32; 4 * self.world];
        self.all_gather(&local, &mut all)?;
        Ok(all
            .chunks(4)
            .map(|p| {
                p.iter()
                    .enumerate()
                    .fold(0u64, |v, (i, &x)| v | ((x as u64) << (16 * i)))
            })
            .collect())
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock is a failed rank: the state stays usable to say so.
        self.shared
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Waits until every rank has arrived; the last to arrive opens the barrier.
    fn barrier<'a>(
        &'a self,
        mut s: MutexGuard<'a, State>,
    ) -> Result<MutexGuard<'a, State>, CommError> {
        if let Some(rank) = s.failed {
            return Err(CommError::PeerFailed { rank });
        }
        s.arrived[self.rank] = true;
        if s.arrived.iter().all(|&a| a) {
            s.arrived.iter_mut().for_each(|a| *a = false);
            s.generation += 1;
            self.shared.changed.notify_all();
            return Ok(s);
        }
        let generation = s.generation;
        let start = Instant::now();
        loop {
            let left = self.shared.timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                let missing = (0..self.world).filter(|&r| !s.arrived[r]).collect();
                s.failed = Some(self.rank);
                self.shared.changed.notify_all();
                return Err(CommError::Timeout {
                    waited: self.shared.timeout,
                    missing,
                });
            }
            s = match self.shared.changed.wait_timeout(s, left) {
                Ok((g, _)) => g,
                Err(poisoned) => poisoned.into_inner().0,
            };
            if s.generation != generation {
                return Ok(s);
            }
            if let Some(rank) = s.failed {
                return Err(CommError::PeerFailed { rank });
            }
        }
    }

    /// Deposit, wait for all, let `read` see every slot, wait again so no slot is overwritten early.
    fn exchange(&self, local: &[f32], read: impl FnOnce(&[Vec<f32>])) -> Result<(), CommError> {
        let mut s = self.lock();
        if let Some(rank) = s.failed {
            return Err(CommError::PeerFailed { rank });
        }
        let slot = &mut s.slots[self.rank];
        slot.clear();
        slot.extend_from_slice(local);
        let s = self.barrier(s)?;
        if let Some((rank, got)) = s
            .slots
            .iter()
            .enumerate()
            .find(|(_, v)| v.len() != local.len())
            .map(|(r, v)| (r, v.len()))
        {
            return Err(CommError::LengthMismatch {
                rank,
                expected: local.len(),
                got,
            });
        }
        read(&s.slots);
        let _s = self.barrier(s)?;
        Ok(())
    }
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&self, data: &mut [f32]) -> Result<(), CommError> {
        if self.world == 1 {
            return Ok(());
        }
        let local = data.to_vec();
        self.exchange(&local, |slots| {
            data.copy_from_slice(&slots[0]);
            for slot in &slots[1..] {
                for (d, v) in data.iter_mut().zip(slot) {
                    *d += v;
                }
            }
        })
    }

    fn all_gather(&self, local: &[f32], out: &mut [f32]) -> Result<(), CommError> {
        assert_eq!(
            out.len(),
            local.len() * self.world,
            "all_gather: out must hold world x local values"
        );
        if self.world == 1 {
            out.copy_from_slice(local);
            return Ok(());
        }
        self.exchange(local, |slots| {
            for (chunk, slot) in out.chunks_mut(local.len().max(1)).zip(slots) {
                chunk.copy_from_slice(slot);
            }
        })
    }

    fn abort(&self) {
        let mut s = self.lock();
        s.failed.get_or_insert(self.rank);
        self.shared.changed.notify_all();
    }
}

/// One rank's view of its group's failure state, detached from the communicator's lifetime.
#[derive(Clone)]
pub struct GroupHealth {
    rank: usize,
    shared: Arc<Shared>,
}

impl GroupHealth {
    fn state(&self) -> MutexGuard<'_, State> {
        self.shared
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The rank that failed the group first, if any has.
    pub fn failed(&self) -> Option<usize> {
        self.state().failed
    }

    /// Fails the group in this rank's name (the others' next collective returns `PeerFailed`).
    pub fn fail(&self) {
        let mut s = self.state();
        s.failed.get_or_insert(self.rank);
        self.shared.changed.notify_all();
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    /// How long a collective may wait for the others.
    pub fn timeout(&self) -> Duration {
        self.shared.timeout
    }
}

impl Drop for ThreadComm {
    fn drop(&mut self) {
        // A rank that goes away mid-run (error return, panic) must not leave the others waiting.
        // After a clean finish nobody waits any more, so marking the group failed is harmless.
        self.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread;

    fn run<T: Send + 'static>(
        world: usize,
        timeout: Duration,
        body: impl Fn(ThreadComm) -> T + Send + Sync + 'static,
    ) -> Vec<thread::Result<T>> {
        let body = Arc::new(body);
        let handles: Vec<_> = ThreadComm::group(world, timeout)
            .into_iter()
            .map(|c| {
                let body = body.clone();
                thread::spawn(move || body(c))
            })
            .collect();
        handles.into_iter().map(|h| h.join()).collect()
    }

    #[test]
    fn all_reduce_sums_in_rank_order_and_every_rank_agrees() {
        for world in [1, 2, 3, 4] {
            let out = run(world, Duration::from_secs(10), move |c| {
                let mut last = Vec::new();
                // Many rounds reuse the slots: the second barrier must keep them apart.
                for round in 0..50 {
                    let mut v: Vec<f32> = (0..7)
                        .map(|i| (c.rank() * 100 + i + round) as f32 * 0.1)
                        .collect();
                    c.all_reduce_sum(&mut v).unwrap();
                    last = v;
                }
                last
            });
            let results: Vec<Vec<f32>> = out.into_iter().map(|r| r.unwrap()).collect();
            let expected: Vec<f32> = (0..7)
                .map(|i| (0..world).fold(0.0f32, |acc, r| acc + (r * 100 + i + 49) as f32 * 0.1))
                .collect();
            for r in &results {
                assert_eq!(r, &expected, "world {world}");
            }
        }
    }

    #[test]
    fn all_gather_concatenates_in_rank_order() {
        let out = run(3, Duration::from_secs(10), |c| {
            let local = vec![c.rank() as f32; 2];
            let mut all = vec![0.0; 6];
            c.all_gather(&local, &mut all).unwrap();
            all
        });
        for r in out {
            assert_eq!(r.unwrap(), vec![0.0, 0.0, 1.0, 1.0, 2.0, 2.0]);
        }
    }

    #[test]
    fn a_panicking_rank_fails_the_others_instead_of_hanging() {
        let start = Instant::now();
        let out = run(4, Duration::from_secs(60), |c| {
            let mut v = vec![1.0f32; 4];
            c.all_reduce_sum(&mut v)?;
            if c.rank() == 2 {
                panic!("rank 2 fails between collectives");
            }
            c.all_reduce_sum(&mut v)?;
            Ok::<_, CommError>(v)
        });
        assert!(out[2].is_err(), "rank 2 panicked");
        for (rank, r) in out.into_iter().enumerate().filter(|(r, _)| *r != 2) {
            assert_eq!(
                r.unwrap(),
                Err(CommError::PeerFailed { rank: 2 }),
                "rank {rank}"
            );
        }
        // Well under the 60 s timeout: the failure is seen at once, not by timing out.
        assert!(start.elapsed() < Duration::from_secs(30));
    }

    #[test]
    fn a_stuck_rank_times_out_the_group() {
        let out = run(2, Duration::from_millis(200), |c| {
            if c.rank() == 1 {
                thread::sleep(Duration::from_millis(1500));
                return Ok(vec![]);
            }
            let mut v = vec![1.0f32];
            c.all_reduce_sum(&mut v).map(|_| v)
        });
        let r0 = out.into_iter().next().unwrap().unwrap();
        assert!(
            matches!(r0, Err(CommError::Timeout { ref missing, .. }) if missing == &[1]),
            "{r0:?}"
        );
    }

    #[test]
    fn bytes_broadcast_from_the_root_reach_every_rank() {
        let out = run(4, Duration::from_secs(10), |c| {
            // Only rank 2's bytes matter; every value of a byte must survive the trip.
            let mut token: Vec<u8> = if c.rank() == 2 {
                (0..=255u8).rev().collect()
            } else {
                vec![c.rank() as u8; 256]
            };
            c.broadcast_bytes(2, &mut token).map(|()| token)
        });
        let expected: Vec<u8> = (0..=255u8).rev().collect();
        for r in out {
            assert_eq!(r.unwrap().unwrap(), expected);
        }
    }

    #[test]
    fn u64s_gathered_keep_every_bit() {
        let value = |rank: usize| 0xfedc_ba98_7654_3210u64.rotate_left(rank as u32 * 7);
        let out = run(3, Duration::from_secs(10), move |c| {
            c.all_gather_u64(value(c.rank()))
        });
        for r in out {
            assert_eq!(r.unwrap().unwrap(), vec![value(0), value(1), value(2)]);
        }
    }

    #[test]
    fn health_sees_a_failure_and_fails_the_group() {
        let comms = ThreadComm::group(2, Duration::from_secs(10));
        let health = comms[1].health();
        assert_eq!(health.failed(), None);
        health.fail();
        assert_eq!(comms[0].health().failed(), Some(1));
        let mut v = vec![1.0f32];
        assert_eq!(
            comms[0].all_reduce_sum(&mut v),
            Err(CommError::PeerFailed { rank: 1 })
        );
    }

    #[test]
    fn mismatched_lengths_are_an_error_not_garbage() {
        let out = run(2, Duration::from_secs(10), |c| {
            let mut v = vec![1.0f32; 3 + c.rank()];
            c.all_reduce_sum(&mut v)
        });
        for r in out {
            assert!(matches!(r.unwrap(), Err(CommError::LengthMismatch { .. })));
        }
    }
}
