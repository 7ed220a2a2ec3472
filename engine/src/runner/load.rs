//! From a model path and the serving settings to a runner over the chosen device: the
//! tensor-parallel peers first (each loads its own shard), then rank 0's shard, then the EAGLE-3
//! head, then the runner itself.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::device::{Device, WithBackend};
use super::memory::kv_tokens_for_fraction;
use super::{ModelInfo, ModelRunner, Runner, RunnerConfig};
use crate::backend::{Backend, Precision};
use crate::error::{Error, Result};
use crate::load::load_model_shard;
use crate::model::Eagle3Draft;
use crate::parallel::{PeerConfig, Shard, TpGroup};
use crate::speculation::SpecMethod;

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
    /// How the GPU ranks' collectives are set up.
    pub group: crate::parallel::GroupOptions,
    /// How tensor parallelism splits the routed experts of an MoE model.
    pub moe_split: crate::parallel::MoeSplit,
    /// The EAGLE-3 draft head's directory.
    pub draft_model: Option<PathBuf>,
    /// `--mem-fraction-static`: when set, `runner.kv_tokens` is replaced by what this fraction of
    /// the device's memory leaves after the weights (measured once they are on it).
    pub mem_fraction: Option<f64>,
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
    spec.device.check(spec.precision)?;
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
        let mut runner_cfg = spec.runner;
        // The head every rank holds a shard of: only when the runner will draft with it.
        let drafting_head = spec
            .draft_model
            .clone()
            .filter(|_| runner_cfg.spec.method == SpecMethod::Eagle3);
        let shard = Shard {
            rank: 0,
            world,
            moe: spec.moe_split,
        };
        let before = backend.memory();
        // Ranks 1.. load their shards on their own threads first; any failure stops the start.
        let tp = if world > 1 {
            status(format!("loading ranks 1..{world} of tensor parallelism"));
            let cfg = PeerConfig {
                device: spec.device,
                model: spec.model.clone(),
                precision: spec.precision,
                threads_per_rank: per_rank,
                block_size: spec.runner.block_size,
                group: spec.group,
                moe: spec.moe_split,
                draft_model: drafting_head.clone(),
            };
            Some(TpGroup::spawn(
                cfg,
                world,
                spec.collective_timeout,
                &backend,
            )?)
        } else {
            None
        };
        let mut last = 0;
        let started = Instant::now();
        let model = load_model_shard(
            backend,
            &spec.model,
            spec.precision,
            shard,
            |done, total| {
                if done != last {
                    last = done;
                    status(format!("loading layer {done}/{total}"));
                }
            },
        )?;
        let loaded = format!(
            "weights loaded in {:.1} s on {}",
            started.elapsed().as_secs_f64(),
            model.backend.describe()
        );
        tracing::info!("{loaded}");
        status(loaded);
        let draft = match &drafting_head {
            Some(dir) => {
                status("loading the EAGLE-3 draft head".into());
                Some(Eagle3Draft::load_shard(
                    &model.backend,
                    dir,
                    model.config(),
                    spec.precision,
                    shard,
                )?)
            }
            None => None,
        };
        if let Some(fraction) = spec.mem_fraction {
            let (Some(before), Some(after)) = (before, model.backend.memory()) else {
                return Err(Error::Device(
                    "--mem-fraction-static needs a device that reports its memory".into(),
                ));
            };
            let c = model.config();
            // bf16 cells of every layer (K and V, or K alone for MLA's latent), and K and V of
            // the draft head's layer.
            let draft_width = draft.as_ref().map_or(0, |d| d.kv_width());
            let rows = c.kv_layout().rows_per_position();
            let per_token =
                (c.n_layers * model.model.local_kv_width() * rows + draft_width * 2) * 2;
            let weights = before.free.saturating_sub(after.free);
            runner_cfg.kv_tokens = kv_tokens_for_fraction(
                after.total,
                fraction,
                weights,
                per_token,
                runner_cfg.block_size,
            )?;
            status(format!(
                "weights take {:.2} GiB; --mem-fraction-static {fraction} leaves {} KV tokens",
                weights as f64 / (1u64 << 30) as f64,
                runner_cfg.kv_tokens
            ));
        }
        let info = Arc::new(ModelInfo {
            name: model.name.clone(),
            config: model.config().clone(),
            tokenizer: model.tokenizer.clone(),
            precision: spec.precision,
            device: spec.device,
            backend: model.backend.describe(),
        });
        if let Some(tp) = &tp {
            // Every rank's cache holds the same blocks; rank 0 knows how many fit.
            tp.size_caches(runner_cfg.n_blocks())?;
        }
        let runner = Runner::new(model, info.clone(), runner_cfg, tp, draft)?;
        Ok((Box::new(runner), info))
    }
}
