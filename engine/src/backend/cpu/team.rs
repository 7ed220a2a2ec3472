//! A small team of worker threads that spin briefly between jobs. A decode step issues ~150 short
//! parallel loops; waking sleeping threads for each (what a general-purpose pool does after a few
//! microseconds idle) costs more than the loop. Workers spin, then yield, then sleep, so an idle server
//! does not burn CPU.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// One parallel loop, on the dispatching thread's stack.
struct Job {
    f: *const (dyn Fn(usize) + Sync),
    n_tasks: usize,
    next: AtomicUsize,
    done: AtomicUsize,
    /// The first panic of a task, resumed on the dispatching thread once no worker holds the
    /// job (a task that panics still counts as done, so nobody waits for it forever).
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
}

#[derive(Clone, Copy)]
struct JobPtr(*const Job);
// SAFETY: a JobPtr is only dereferenced while the dispatcher keeps the Job alive (see `run`).
unsafe impl Send for JobPtr {}

struct Shared {
    epoch: AtomicU64,
    /// The current job, present only while its dispatcher is inside `run`.
    slot: Mutex<Option<(u64, JobPtr)>>,
    /// Workers that took the current job and have not finished with it.
    active: AtomicUsize,
    sleeping: AtomicUsize,
    wake: Condvar,
    shutdown: AtomicBool,
}

pub struct Team {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Serialises dispatchers: one job at a time.
    dispatch: Mutex<()>,
}

/// How long an idle worker spins, then yields, before it sleeps.
const SPIN_FOR: Duration = Duration::from_micros(200);
const YIELD_FOR: Duration = Duration::from_millis(5);

impl Team {
    /// A team of `threads` in all: the dispatching thread plus `threads - 1` workers.
    pub fn new(threads: usize) -> Team {
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            slot: Mutex::new(None),
            active: AtomicUsize::new(0),
            sleeping: AtomicUsize::new(0),
            wake: Condvar::new(),
            shutdown: AtomicBool::new(false),
        });
        let workers = (1..threads.max(1))
            .map(|i| {
                let s = shared.clone();
                std::thread::Builder::new()
                    .name(format!("kiln-cpu-{i}"))
                    .spawn(move || worker(&s))
                    .expect("spawning a CPU worker thread")
            })
            .collect();
        Team {
            shared,
            workers,
            dispatch: Mutex::new(()),
        }
    }

    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f(i)` for every `i` in `0..n_tasks` across the team; returns when all are done.
    pub fn run(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if n_tasks == 0 {
            return;
        }
        if n_tasks == 1 || self.workers.is_empty() {
            (0..n_tasks).for_each(f);
            return;
        }
        let _one_at_a_time = self.dispatch.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the lifetime is erased only for the duration of this call: the job leaves the slot and
        // every worker holding it has finished before `run` returns.
        let f: *const (dyn Fn(usize) + Sync) = unsafe { std::mem::transmute(f) };
        let job = Job {
            f,
            n_tasks,
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            panic: Mutex::new(None),
        };
        let s = &*self.shared;
        let epoch = s.epoch.load(Ordering::Relaxed) + 1;
        *s.slot.lock().unwrap_or_else(|e| e.into_inner()) = Some((epoch, JobPtr(&job)));
        s.epoch.store(epoch, Ordering::Release);
        if s.sleeping.load(Ordering::Acquire) > 0 {
            // Under the lock, so no worker is between its epoch check and its wait.
            let _guard = s.slot.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        work_on(&job);
        while job.done.load(Ordering::Acquire) < n_tasks {
            std::hint::spin_loop();
        }
        *s.slot.lock().unwrap_or_else(|e| e.into_inner()) = None;
        while s.active.load(Ordering::Acquire) > 0 {
            std::hint::spin_loop();
        }
        // Only now, with no worker left holding the job, may the caller unwind.
        let panicked = job.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(payload) = panicked {
            std::panic::resume_unwind(payload);
        }
    }
}

/// A slice's base pointer, shared by tasks that each touch a disjoint range of it.
struct SlicePtr<T>(*mut T);
// SAFETY: only used by `for_each_chunk_mut`, whose tasks get disjoint ranges.
unsafe impl<T: Send> Send for SlicePtr<T> {}
unsafe impl<T: Send> Sync for SlicePtr<T> {}

impl Team {
    /// Splits `data` into contiguous chunks of whole `unit`s (a row's width, or 1 for element-wise
    /// work), at least `min_units` each and one per thread at most, and runs `f(first_unit, chunk)`
    /// on each across the team. Small inputs run on the calling thread: a hand-off to a spinning
    /// worker is cheap, but not free.
    pub fn for_each_chunk_mut<T: Send>(
        &self,
        data: &mut [T],
        unit: usize,
        min_units: usize,
        f: &(dyn Fn(usize, &mut [T]) + Sync),
    ) {
        let unit = unit.max(1);
        let n_units = data.len() / unit;
        let per_task = n_units.div_ceil(self.threads()).max(min_units.max(1));
        let n_tasks = n_units.div_ceil(per_task);
        if n_tasks <= 1 {
            f(0, data);
            return;
        }
        let (base, len) = (SlicePtr(data.as_mut_ptr()), data.len());
        self.run(n_tasks, &|task| {
            let base = &base;
            let first = task * per_task;
            let start = first * unit;
            // The last chunk takes any partial unit at the end too.
            let end = if task + 1 == n_tasks {
                len
            } else {
                (first + per_task) * unit
            };
            // SAFETY: tasks cover disjoint ranges of `data`, which outlives `run`.
            let chunk = unsafe { std::slice::from_raw_parts_mut(base.0.add(start), end - start) };
            f(first, chunk);
        });
    }
}

fn work_on(job: &Job) {
    loop {
        let i = job.next.fetch_add(1, Ordering::Relaxed);
        if i >= job.n_tasks {
            return;
        }
        // SAFETY: the closure outlives the job (see `Team::run`).
        let f = unsafe { &*job.f };
        if let Err(payload) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(i))) {
            let mut first = job.panic.lock().unwrap_or_else(|e| e.into_inner());
            first.get_or_insert(payload);
        }
        job.done.fetch_add(1, Ordering::Release);
    }
}

fn worker(s: &Shared) {
    let mut seen = 0u64;
    loop {
        let idle_since = Instant::now();
        let mut spins = 0u32;
        let mut idle = Duration::ZERO;
        loop {
            if s.shutdown.load(Ordering::Acquire) {
                return;
            }
            if s.epoch.load(Ordering::Acquire) != seen {
                break;
            }
            // Reading the clock costs more than a spin: look at it every 64th turn only.
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) {
                idle = idle_since.elapsed();
            }
            if idle < SPIN_FOR {
                std::hint::spin_loop();
            } else if idle < YIELD_FOR {
                std::thread::yield_now();
            } else {
                let guard = s.slot.lock().unwrap_or_else(|e| e.into_inner());
                s.sleeping.fetch_add(1, Ordering::AcqRel);
                if s.epoch.load(Ordering::Acquire) == seen && !s.shutdown.load(Ordering::Acquire) {
                    let _ = s.wake.wait_timeout(guard, Duration::from_millis(50));
                }
                s.sleeping.fetch_sub(1, Ordering::AcqRel);
            }
        }
        seen = s.epoch.load(Ordering::Acquire);
        let job = {
            let slot = s.slot.lock().unwrap_or_else(|e| e.into_inner());
            match *slot {
                Some((_, p)) => {
                    s.active.fetch_add(1, Ordering::AcqRel);
                    Some(p)
                }
                None => None,
            }
        };
        if let Some(JobPtr(p)) = job {
            // SAFETY: `active` was raised under the slot lock while the job was published, so the
            // dispatcher waits for this worker before the job goes out of scope.
            work_on(unsafe { &*p });
            s.active.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        self.shared.wake.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_every_unit_once_in_whole_units() {
        let team = Team::new(2);
        for (len, unit, min_units) in [(0, 4, 1), (12, 4, 1), (1000, 7, 3), (1001, 1, 512)] {
            let mut data = vec![0u32; len];
            team.for_each_chunk_mut(&mut data, unit, min_units, &|first, chunk| {
                for (i, v) in chunk.iter_mut().enumerate() {
                    *v += (first * unit + i) as u32 + 1;
                }
            });
            let want: Vec<u32> = (1..=len as u32).collect();
            assert_eq!(data, want, "len {len} unit {unit}");
        }
    }

    #[test]
    fn every_task_runs_exactly_once_across_many_jobs() {
        let team = Team::new(3);
        for n in [0usize, 1, 2, 7, 64, 1000] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            team.run(n, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "n = {n}"
            );
        }
    }

    #[test]
    fn a_panicking_task_reaches_the_caller_without_a_hang_and_the_team_goes_on() {
        let team = Team::new(3);
        for bad in [0usize, 5, 99] {
            let ran = AtomicUsize::new(0);
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                team.run(100, &|i| {
                    ran.fetch_add(1, Ordering::Relaxed);
                    assert!(i != bad, "task {i} fails");
                })
            }));
            let payload = r.expect_err("the task's panic reaches the caller");
            let msg = payload
                .downcast_ref::<String>()
                .cloned()
                .unwrap_or_default();
            assert!(msg.contains(&format!("task {bad} fails")), "{msg}");
            // The other tasks still ran: the job ended whole before the caller unwound.
            assert_eq!(ran.load(Ordering::Relaxed), 100);
        }
        let sum = AtomicUsize::new(0);
        team.run(100, &|i| {
            sum.fetch_add(i, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 4950);
    }

    #[test]
    fn works_after_workers_fell_asleep() {
        let team = Team::new(2);
        std::thread::sleep(YIELD_FOR + Duration::from_millis(20));
        let sum = AtomicUsize::new(0);
        team.run(100, &|i| {
            sum.fetch_add(i, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 4950);
    }
}
