//! CUDA graphs for decode steps. The runner pads a decode batch to a bucket and, per bucket,
//! has the backend record one forward into a graph at warm-up; every later step of that bucket
//! replays it. A replay runs the same forward on the host with launches suppressed: each op
//! still stages its inputs (step metadata, token ids, row lists) at the offsets the recording
//! used (staging.rs); one copy puts them where the graph's kernels read, and the graph is
//! launched whole: one launch instead of hundreds.
//!
//! What makes a recorded step valid for every later step of its bucket: buffers sized by a
//! warm-up step first (an allocation inside a graph is refused), block tables padded to one
//! width, and attention split by a context bound rather than this step's context (each token
//! divides its own context among the splits, so the split count may be fixed).

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::Ordering;

use cudarc::driver::{CudaGraph, sys};

use super::backend::{CudaBackend, dev};
use crate::backend::GraphPhase;
use crate::error::{Error, Result};

/// What the ops do now.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum GraphMode {
    /// Launch as they go.
    #[default]
    Eager,
    /// Launch as they go, shaped for a graph (attention split for its context bound).
    WarmUp,
    /// Record into the graph of a bucket.
    Capture,
    /// Stage inputs only, for the graph of a bucket.
    Replay,
}

/// A recorded graph. cudarc's graph is not `Send`: it is used only under the backend's lock.
struct Recorded(CudaGraph);

// SAFETY: every use of the graph happens with the `Graphs` mutex held, one thread at a time.
unsafe impl Send for Recorded {}

#[derive(Default)]
pub struct Graphs {
    mode: GraphMode,
    /// The bucket being recorded or replayed.
    bucket: usize,
    /// The longest context a graph's steps attend over (fixes the attention's split count).
    context_bound: usize,
    recorded: HashMap<usize, Recorded>,
}

/// Destroys every recorded graph (before the communicator their collectives reference is
/// aborted: see `nccl_comm`'s `Handle`). Callable from the watchdog's thread: the lock serializes
/// it with launches, and the context is bound there.
pub(super) fn destroy_all(graphs: &Mutex<Graphs>) {
    let mut g = graphs.lock().unwrap_or_else(|p| p.into_inner());
    g.recorded.clear();
}

impl CudaBackend {
    fn graphs(&self) -> Result<std::sync::MutexGuard<'_, Graphs>> {
        self.graphs
            .lock()
            .map_err(|_| Error::Device("the CUDA graph state was poisoned".into()))
    }

    pub(super) fn graph_mode(&self) -> Result<GraphMode> {
        Ok(self.graphs()?.mode)
    }

    pub(super) fn graph_recorded(&self, bucket: usize) -> bool {
        self.graphs()
            .is_ok_and(|g| g.recorded.contains_key(&bucket))
    }

    pub(super) fn graph_context_bound(&self) -> Result<usize> {
        Ok(self.graphs()?.context_bound)
    }

    /// Starts a phase of the graph of `bucket` (`GraphPhase`).
    pub(super) fn graph_begin(
        &self,
        bucket: usize,
        phase: GraphPhase,
        context_bound: usize,
        staging_bytes: usize,
    ) -> Result<()> {
        if self.graph_mode()? != GraphMode::Eager {
            return Err(Error::Device("a CUDA graph began inside another".into()));
        }
        match phase {
            GraphPhase::WarmUp => {}
            // The arena's addresses go into the graph: it must not move afterwards.
            GraphPhase::Record if self.graphs()?.recorded.is_empty() => {
                self.reserve_staging(staging_bytes)?
            }
            GraphPhase::Record => self.check_staging_fits(staging_bytes)?,
            GraphPhase::Replay => {
                if !self.graphs()?.recorded.contains_key(&bucket) {
                    return Err(Error::Device(format!(
                        "no CUDA graph is recorded for batch size {bucket}"
                    )));
                }
            }
        }
        // Outside the graph: a capture may not synchronize, and a replay's staging must start
        // at the offsets the recording used.
        self.restart_staging()?;
        let mut g = self.graphs()?;
        g.bucket = bucket;
        g.context_bound = context_bound;
        g.mode = match phase {
            GraphPhase::WarmUp => GraphMode::WarmUp,
            GraphPhase::Record => {
                let watch = self.group_watch()?;
                if let Some(w) = &watch {
                    w.capture_begins().map_err(Error::Parallel)?;
                }
                let begun = self
                    .stream()
                    .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                    .map_err(dev("begin graph capture"));
                if let Err(e) = begun {
                    drop(g);
                    if let Some(w) = &watch {
                        w.capture_ends();
                    }
                    return Err(e);
                }
                GraphMode::Capture
            }
            GraphPhase::Replay => {
                self.replaying.store(true, Ordering::Relaxed);
                GraphMode::Replay
            }
        };
        Ok(())
    }

    /// A buffer a graph may point at was reallocated: every recorded graph is dropped (the
    /// runner records again what it needs).
    pub(super) fn forget_graphs(&self) -> Result<()> {
        let mut g = self.graphs()?;
        if !g.recorded.is_empty() {
            tracing::debug!("a buffer grew: the recorded CUDA graphs are dropped");
            g.recorded.clear();
        }
        Ok(())
    }

    /// The tensor-parallel group's watch on this rank's graphs (`None` alone).
    fn group_watch(&self) -> Result<Option<super::ReplayWatch>> {
        Ok(self
            .replay_watch
            .lock()
            .map_err(|_| Error::Device("the replay watch was poisoned".into()))?
            .clone())
    }

    /// Ends a recording (keeping the graph) or launches the replayed one.
    pub(super) fn graph_end(&self) -> Result<()> {
        let mut g = self.graphs()?;
        let bucket = g.bucket;
        match std::mem::take(&mut g.mode) {
            GraphMode::Eager => Err(Error::Device("a CUDA graph ended that never began".into())),
            GraphMode::WarmUp => Ok(()),
            GraphMode::Capture => {
                let kept = (|| -> Result<()> {
                    let graph = self
                        .stream()
                        .end_capture(sys::CUgraphInstantiate_flags(0))
                        .map_err(dev("end graph capture"))?
                        .ok_or_else(|| Error::Device("the CUDA graph capture was empty".into()))?;
                    graph.upload().map_err(dev("graph upload"))?;
                    g.recorded.insert(bucket, Recorded(graph));
                    Ok(())
                })();
                // An abort that came during the capture runs now, outside the graph lock (it
                // destroys the recorded graphs first, this one included).
                drop(g);
                if let Some(w) = self.group_watch()? {
                    w.capture_ends();
                }
                kept
            }
            GraphMode::Replay => {
                self.replaying.store(false, Ordering::Relaxed);
                let graph = g.recorded.get(&bucket).ok_or_else(|| {
                    Error::Device(format!("no CUDA graph for batch size {bucket}"))
                })?;
                self.upload_staged()?;
                graph.0.launch().map_err(dev("graph launch"))?;
                // Under tensor parallelism the graph holds the step's collectives: the group's
                // watchdog holds the launch to the deadline as it would each of them.
                let watch = self
                    .replay_watch
                    .lock()
                    .map_err(|_| Error::Device("the replay watch was poisoned".into()))?
                    .clone();
                match watch {
                    Some(w) => w.after_launch().map_err(Error::Parallel),
                    None => Ok(()),
                }
            }
        }
    }

    /// Leaves graph mode after a failure in between; a broken recording is discarded.
    pub(super) fn graph_abort(&self) {
        self.replaying.store(false, Ordering::Relaxed);
        let captured = match self.graphs.lock() {
            Ok(mut g) => std::mem::take(&mut g.mode) == GraphMode::Capture,
            Err(_) => false,
        };
        if captured {
            // Ending the capture is the only way out of it; the partial graph is dropped, then an
            // abort that came during the capture runs.
            let _ = self.stream().end_capture(sys::CUgraphInstantiate_flags(0));
            if let Ok(Some(w)) = self.group_watch() {
                w.capture_ends();
            }
        }
    }
}
