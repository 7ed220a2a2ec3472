//! From a model path and the serving settings to a runner over the chosen device: the
//! tensor-parallel peers first (each loads its own shard), then rank 0's shard, then the EAGLE-3
//! head, then the runner itself.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::device::{Device, WithBackend};
use super::{ModelInfo, ModelRunner, Runner, RunnerConfig};
use crate::backend::{Backend, Precision};
use crate::error::Result;
use crate::load::load_model_shard;
use crate::model::Eagle3Draft;
use crate::parallel::{PeerConfig, Shard, TpGroup};

/// Everything a runner is built from.
#[derive(Clone, Debug)]
pub struct LoadSpec {
    pub device: Device,
    pub model: PathBuf,
    pub precision: Precision,
    /// CPU compute threads in all, split evenly across tensor-parallel ranks (default: every core).
    pub threads: Option<usize>,
    /// Ranks of tensor parallelism (1: the whole model on the engine thread).
    pub tensor_parallel: usize,
    /// How long a collective waits for a stalled rank before the group fails.
    pub collective_timeout: Duration,
    /// The EAGLE-3 draft head's directory.
    pub draft_model: Option<PathBuf>,
    pub runner: RunnerConfig,
}

impl LoadSpec {
    fn threads_per_rank(&self) -> usize {
        let all = self.threads.unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        });
        (all / self.tensor_parallel.max(1)).max(1)
    }
}

/// Loads the model as `spec` says; `status` hears each stage ("loading layer 3/30", ...).
pub fn load(
    spec: &LoadSpec,
    status: &mut dyn FnMut(String),
) -> Result<(Box<dyn ModelRunner>, Arc<ModelInfo>)> {
    spec.device
        .check(spec.precision, spec.tensor_parallel.max(1))?;
    let per_rank = spec.threads_per_rank();
    spec.device.with_backend(
        Some(per_rank),
        Job {
            spec,
            status,
            per_rank,
        },
    )?
}

struct Job<'a> {
    spec: &'a LoadSpec,
    status: &'a mut dyn FnMut(String),
    per_rank: usize,
}

impl WithBackend for Job<'_> {
    type Output = Result<(Box<dyn ModelRunner>, Arc<ModelInfo>)>;

    fn run<B: Backend + 'static>(self, backend: B) -> Self::Output {
        let Job {
            spec,
            status,
            per_rank,
        } = self;
        let world = spec.tensor_parallel.max(1);
        // Ranks 1.. load their shards on their own threads first; any failure stops the start.
        let tp = if world > 1 {
            status(format!("loading ranks 1..{world} of tensor parallelism"));
            let cfg = PeerConfig {
                device: spec.device,
                model: spec.model.clone(),
                precision: spec.precision,
                threads_per_rank: per_rank,
                n_blocks: spec.runner.n_blocks(),
                block_size: spec.runner.block_size,
            };
            Some(TpGroup::spawn(cfg, world, spec.collective_timeout)?)
        } else {
            None
        };
        let mut last = 0;
        let model = load_model_shard(
            backend,
            &spec.model,
            spec.precision,
            Shard { rank: 0, world },
            |done, total| {
                if done != last {
                    last = done;
                    status(format!("loading layer {done}/{total}"));
                }
            },
        )?;
        let draft = match &spec.draft_model {
            Some(dir) => {
                status("loading the EAGLE-3 draft head".into());
                Some(Eagle3Draft::load(
                    &model.backend,
                    dir,
                    model.config(),
                    spec.precision,
                )?)
            }
            None => None,
        };
        let info = Arc::new(ModelInfo {
            name: model.name.clone(),
            config: model.config().clone(),
            tokenizer: model.tokenizer.clone(),
            precision: spec.precision,
            device: spec.device,
            backend: model.backend.describe(),
        });
        let runner = Runner::new(model, info.clone(), spec.runner, tp, draft)?;
        Ok((Box::new(runner), info))
    }
}
