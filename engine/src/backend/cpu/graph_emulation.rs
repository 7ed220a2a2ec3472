//! Graph phases on the CPU, for tests only (`KILN_CPU_EMULATE_GRAPHS=1` in the process's
//! environment): the CPU records nothing, and every phase runs its ops as they come, but the
//! backend keeps the bookkeeping a recording backend keeps (which buckets are recorded, which
//! phase is open). So the runner's and the tensor-parallel group's graph protocol (warm-up,
//! record, replay, every rank agreeing) runs end to end where no GPU is, and a step replayed
//! this way computes exactly what an eager one does.

use std::collections::HashSet;
use std::sync::Mutex;

use crate::backend::GraphPhase;
use crate::error::{Error, Result};

/// The environment variable that turns the emulation on (read when a backend is built).
pub const EMULATE_GRAPHS_ENV: &str = "KILN_CPU_EMULATE_GRAPHS";

#[derive(Default)]
pub struct EmulatedGraphs {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// The open phase and its bucket.
    open: Option<(GraphPhase, usize)>,
    recorded: HashSet<usize>,
}

impl EmulatedGraphs {
    /// The emulation when the environment asks for it.
    pub fn from_env() -> Option<EmulatedGraphs> {
        (std::env::var(EMULATE_GRAPHS_ENV).as_deref() == Ok("1")).then(EmulatedGraphs::default)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn begin(&self, bucket: usize, phase: GraphPhase) -> Result<()> {
        let mut s = self.state();
        if s.open.is_some() {
            return Err(Error::Device("a graph began inside another".into()));
        }
        if phase == GraphPhase::Replay && !s.recorded.contains(&bucket) {
            return Err(Error::Device(format!(
                "no graph is recorded for batch size {bucket}"
            )));
        }
        s.open = Some((phase, bucket));
        Ok(())
    }

    pub fn end(&self) -> Result<()> {
        let mut s = self.state();
        match s.open.take() {
            Some((GraphPhase::Record, bucket)) => {
                s.recorded.insert(bucket);
                Ok(())
            }
            Some(_) => Ok(()),
            None => Err(Error::Device("a graph ended that never began".into())),
        }
    }

    pub fn abort(&self) {
        self.state().open = None;
    }

    pub fn has(&self, bucket: usize) -> bool {
        self.state().recorded.contains(&bucket)
    }
}
