//! A rank's collective watchdog: the device collectives are enqueued and left to run while the
//! host goes on launching the step's next kernels (waiting on each would idle the GPU once per
//! collective, 122 times a Kimi-K2 token). A thread of its own watches them in stream order: each
//! must finish within the group's timeout of the moment it could start (its enqueue, or the
//! previous one's end). On a timeout, a device error or a peer's failure it runs `abort` (NCCL:
//! `ncclCommAbort`, which ends the stuck kernels so the stream drains), fails the group in this
//! rank's name and keeps the reason; the rank learns it at the end of its step
//! ([`Watchdog::outcome`]), where it synchronizes with the device anyway.

use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::deadline::{Pace, wait_for};
use super::{CommError, GroupHealth, Progress};

/// Something enqueued on the device whose end can be polled (an event after a collective).
pub trait Completion: Send {
    fn poll(&self) -> Progress;
}

struct Watched {
    item: Box<dyn Completion>,
    enqueued: Instant,
}

/// How often an idle watchdog looks at the group.
const IDLE_LOOK: Duration = Duration::from_millis(50);

pub struct Watchdog {
    tx: Option<Sender<Watched>>,
    failure: Arc<Mutex<Option<CommError>>>,
    handle: Option<JoinHandle<()>>,
}

impl Watchdog {
    /// Starts the thread. `setup` runs on it first (binding the device context); `abort` runs on
    /// it at most once.
    pub fn start(
        health: GroupHealth,
        setup: impl FnOnce() + Send + 'static,
        abort: impl Fn() + Send + 'static,
    ) -> std::io::Result<Watchdog> {
        let (tx, rx) = channel();
        let failure = Arc::new(Mutex::new(None));
        let keep = failure.clone();
        let handle = std::thread::Builder::new()
            .name(format!("kiln-watchdog{}", health.rank()))
            .spawn(move || {
                setup();
                if let Some(e) = watch(&health, &rx) {
                    // The verdict first, before the group hears of it and before aborting ends
                    // the stuck kernels: a step that sees either must already find why.
                    let own = !matches!(e, CommError::PeerFailed { .. });
                    *keep.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                    if own {
                        health.fail();
                    }
                    abort();
                }
                // Drain until the rank drops its sender: later items are moot.
                while rx.recv().is_ok() {}
            })?;
        Ok(Watchdog {
            tx: Some(tx),
            failure,
            handle: Some(handle),
        })
    }

    /// Watches `item`, enqueued now.
    pub fn watch(&self, item: Box<dyn Completion>) {
        if let Some(tx) = &self.tx {
            // A watchdog that already gave up drains; nothing to report here.
            let _ = tx.send(Watched {
                item,
                enqueued: Instant::now(),
            });
        }
    }

    /// What ended the watch, if anything has: the rank's step fails with it.
    pub fn outcome(&self) -> Result<(), CommError> {
        match self
            .failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// The watch loop: returns the first failure, or None when the rank hung up.
fn watch(health: &GroupHealth, rx: &Receiver<Watched>) -> Option<CommError> {
    let mut previous_end = Instant::now();
    loop {
        let w = match rx.recv_timeout(IDLE_LOOK) {
            Ok(w) => w,
            Err(RecvTimeoutError::Timeout) => {
                if let Some(rank) = health.failed() {
                    return Some(CommError::PeerFailed { rank });
                }
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => return None,
        };
        // It could not start before the previous one ended.
        let start = w.enqueued.max(previous_end);
        if let Err(e) = wait_for(health, start, Pace::Patient, || w.item.poll()) {
            return Some(e);
        }
        previous_end = Instant::now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::ThreadComm;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    /// Done once `at` has passed (never, for None).
    struct At(Option<Instant>);
    impl Completion for At {
        fn poll(&self) -> Progress {
            match self.0 {
                Some(t) if Instant::now() >= t => Progress::Done,
                _ => Progress::Pending,
            }
        }
    }

    fn counting_abort() -> (Arc<AtomicUsize>, impl Fn() + Send + 'static) {
        let n = Arc::new(AtomicUsize::new(0));
        let m = n.clone();
        (n, move || {
            m.fetch_add(1, Ordering::SeqCst);
        })
    }

    fn wait_for(what: impl Fn() -> bool, limit: Duration) -> bool {
        let t = Instant::now();
        while t.elapsed() < limit {
            if what() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        false
    }

    #[test]
    fn collectives_that_finish_leave_the_step_clean() {
        let comms = ThreadComm::group(2, Duration::from_secs(10));
        let set_up = Arc::new(AtomicBool::new(false));
        let flag = set_up.clone();
        let (aborts, abort) = counting_abort();
        let dog = Watchdog::start(
            comms[0].health(),
            move || flag.store(true, Ordering::SeqCst),
            abort,
        )
        .expect("thread");
        for i in 0..50 {
            let at = Instant::now() + Duration::from_micros(200 * (i % 3));
            dog.watch(Box::new(At(Some(at))));
        }
        drop(dog); // joins after the queue is drained
        assert!(set_up.load(Ordering::SeqCst));
        assert_eq!(aborts.load(Ordering::SeqCst), 0);
        assert_eq!(comms[1].health().failed(), None);
    }

    #[test]
    fn a_stuck_collective_is_aborted_at_the_deadline_and_the_step_learns_why() {
        let comms = ThreadComm::group(2, Duration::from_millis(300));
        let (aborts, abort) = counting_abort();
        let dog = Watchdog::start(comms[0].health(), || {}, abort).expect("thread");
        let t = Instant::now();
        dog.watch(Box::new(At(None)));
        // Items behind the stuck one are not waited for on their own.
        dog.watch(Box::new(At(None)));
        assert!(wait_for(|| dog.outcome().is_err(), Duration::from_secs(10)));
        let waited = t.elapsed();
        assert!(waited >= Duration::from_millis(300) && waited < Duration::from_secs(5));
        assert!(matches!(dog.outcome(), Err(CommError::Timeout { .. })));
        assert_eq!(aborts.load(Ordering::SeqCst), 1);
        // The other ranks' collectives fail at once.
        assert_eq!(comms[1].health().failed(), Some(0));
    }

    #[test]
    fn a_dead_peer_aborts_a_waiting_collective_well_before_the_deadline() {
        let comms = ThreadComm::group(3, Duration::from_secs(60));
        let (aborts, abort) = counting_abort();
        let dog = Watchdog::start(comms[1].health(), || {}, abort).expect("thread");
        dog.watch(Box::new(At(None)));
        let t = Instant::now();
        comms[2].health().fail();
        assert!(wait_for(|| dog.outcome().is_err(), Duration::from_secs(10)));
        assert!(t.elapsed() < Duration::from_secs(5));
        assert_eq!(dog.outcome(), Err(CommError::PeerFailed { rank: 2 }));
        assert_eq!(aborts.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn an_idle_rank_still_aborts_when_a_peer_dies() {
        // Nothing in flight: the communicator is torn down anyway, so a later enqueue cannot
        // block on the dead peer.
        let comms = ThreadComm::group(2, Duration::from_secs(60));
        let (aborts, abort) = counting_abort();
        let dog = Watchdog::start(comms[0].health(), || {}, abort).expect("thread");
        comms[1].health().fail();
        assert!(wait_for(
            || aborts.load(Ordering::SeqCst) == 1,
            Duration::from_secs(5)
        ));
        assert_eq!(dog.outcome(), Err(CommError::PeerFailed { rank: 1 }));
    }

    #[test]
    fn a_device_error_is_reported_with_the_rank() {
        struct Broken;
        impl Completion for Broken {
            fn poll(&self) -> Progress {
                Progress::Failed("ncclSystemError".into())
            }
        }
        let comms = ThreadComm::group(2, Duration::from_secs(60));
        let (aborts, abort) = counting_abort();
        let dog = Watchdog::start(comms[1].health(), || {}, abort).expect("thread");
        dog.watch(Box::new(Broken));
        assert!(wait_for(|| dog.outcome().is_err(), Duration::from_secs(5)));
        assert_eq!(
            dog.outcome(),
            Err(CommError::Device {
                rank: 1,
                what: "ncclSystemError".into()
            })
        );
        assert_eq!(aborts.load(Ordering::SeqCst), 1);
        assert_eq!(comms[0].health().failed(), Some(1));
    }
}
