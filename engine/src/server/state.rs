//! What every handler shares: options, metrics, and — once loading is done — the model and the
//! engine handle.

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::backend::Precision;
use crate::batching::EngineHandle;
use crate::metrics::Metrics;
use crate::runner::{Device, KvSize, ModelInfo};
use crate::structured::Grammars;

/// `kiln serve`'s settings, resolved from flags and the config file.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    pub model_path: PathBuf,
    /// The id clients send as `model` (default: the file name without `.gguf`).
    pub served_model_name: Option<String>,
    /// `--tool-call-parser`, as `tool-parser`'s name (`None`: read from the chat template).
    pub tool_call_parser: Option<&'static str>,
    /// `--reasoning-parser`, as the `reasoning-parser` crate's name.
    pub reasoning_parser: Option<&'static str>,
    pub host: String,
    pub port: u16,
    /// Web origins whose requests are served, with CORS headers (`--allowed-origins`); any
    /// other request carrying an `Origin` is refused.
    pub allowed_origins: Vec<String>,
    pub api_key: Option<String>,
    pub precision: Precision,
    /// Where the model runs (`--device`).
    pub device: Device,
    pub threads: Option<usize>,
    /// What sizes the KV cache (`--kv-tokens`, or on a GPU `--mem-fraction-static`).
    pub kv: KvSize,
    pub block_size: usize,
    pub max_running: usize,
    pub max_step_tokens: usize,
    /// Cap on prompt + output (default and upper bound: the model's context).
    pub max_model_len: Option<usize>,
    /// Requests in flight (running + waiting) before new ones get 429.
    pub max_queue: usize,
    pub max_body_bytes: usize,
    /// A connection's request headers must arrive within this (silent and idle keep-alive
    /// connections are closed after it).
    pub header_timeout: Duration,
    /// A request's body must arrive within this.
    pub body_timeout: Duration,
    /// Connections open at once, at most (also kept under the file-descriptor limit).
    pub max_connections: usize,
    pub max_n: usize,
    /// Ranks of tensor parallelism (1: the whole model on the engine thread).
    pub tensor_parallel: usize,
    /// How the GPU ranks' collectives are set up (one-shot kernel or NCCL by size).
    pub group: crate::parallel::GroupOptions,
    /// How tensor parallelism splits an MoE model's routed experts.
    pub moe_split: crate::parallel::MoeSplit,
    /// How long a tensor-parallel collective waits for a stalled rank before the group fails.
    pub collective_timeout: Duration,
    pub shutdown_timeout: Duration,
    pub instance: String,
    /// Detokenization off the engine thread, alongside the next step (`--no-overlap`: on it).
    pub detok_overlap: bool,
    /// Steps launched ahead of their results where the backend samples (SGLang's overlap
    /// scheduler; `--disable-overlap-schedule`).
    pub overlap_schedule: bool,
    /// Prompt prefixes reused from the KV cache (`--no-prefix-cache`).
    pub prefix_cache: bool,
    /// Decode steps from CUDA graphs (`--cuda-graph-max-bs`, `--disable-cuda-graph`).
    pub graphs: crate::runner::GraphUse,
    pub spec: crate::speculation::SpecConfig,
    /// The EAGLE-3 draft head's directory (with `--speculative-algorithm eagle3`).
    pub draft_model: Option<PathBuf>,
    /// systemd's `$NOTIFY_SOCKET`.
    pub notify_socket: Option<PathBuf>,
    /// systemd's `$WATCHDOG_USEC`.
    pub watchdog: Option<Duration>,
    /// Set when serving a lock (`--lock`).
    pub lock: Option<LockGuard>,
}

/// What `kiln serve --lock` carries into the server: the start-up checks and the canary.
#[derive(Clone, Debug)]
pub struct LockGuard {
    pub lock_file: String,
    /// The locked config's name.
    pub chosen: String,
    /// The doctor's checks at start (failures are drift).
    pub checks: Vec<crate::doctor::Check>,
    /// Exit when the canary fails (drift policy `refuse`).
    pub refuse: bool,
    pub canary: Option<Canary>,
}

/// A short benchmark after warm-up, compared with the lock's numbers.
#[derive(Clone, Debug)]
pub struct Canary {
    /// The lock's bench settings at one concurrency level.
    pub settings: crate::bench::BenchSettings,
    /// The locked output tok/s at that level.
    pub expected_tok_s: f64,
    /// Passing means at least `(1 - tolerance) * expected_tok_s`.
    pub tolerance: f64,
}

pub struct Ready {
    /// The model as the HTTP side knows it (tokenizer, configuration); the weights stay with
    /// the engine thread's runner.
    pub model: Arc<ModelInfo>,
    pub engine: EngineHandle,
    pub model_id: String,
    pub max_model_len: usize,
    /// Tokens the KV cache holds (as the runner sized it).
    pub kv_tokens: usize,
    pub max_queue: usize,
    pub max_n: usize,
    /// Unix seconds when the model became ready (`created` in /v1/models).
    pub created: u64,
    /// The tool-call format (`--tool-call-parser` or the chat template's); `None`: requests with
    /// tools are refused.
    pub tool_parser: Option<&'static str>,
    /// The structured-outputs compiler over this model's vocabulary, built on first use.
    pub grammars: OnceLock<Result<Arc<Grammars>, String>>,
}

impl Ready {
    /// The structured-outputs compiler (its token table is built by the first call).
    pub fn grammars(&self) -> Result<Arc<Grammars>, String> {
        self.grammars
            .get_or_init(|| {
                let width = self
                    .model
                    .config
                    .vocab_size
                    .max(self.model.tokenizer.vocab_size());
                Grammars::new(&self.model.tokenizer, width).map(Arc::new)
            })
            .clone()
    }
}

pub struct AppState {
    pub opts: ServeOptions,
    pub metrics: Arc<Metrics>,
    pub ready: OnceLock<Arc<Ready>>,
    /// Set on SIGTERM: new generation requests get 503 while in-flight ones finish.
    pub draining: AtomicBool,
    /// Set when the shutdown timeout cuts what is still in flight: streams end with an error
    /// event and `[DONE]`, waiting non-streaming requests get 503.
    pub cut: tokio::sync::watch::Sender<bool>,
    /// Requests being prepared (parsed, templated, tokenized) at once, at most.
    pub prep: tokio::sync::Semaphore,
    /// While the lock's canary benchmark runs, /ready stays 503.
    pub canary_running: AtomicBool,
    /// Checks (start-up and canary) that are not passing, shown by /ready.
    pub drift: std::sync::Mutex<Vec<crate::doctor::Check>>,
}

pub type Shared = Arc<AppState>;

pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl AppState {
    /// Resolves once the shutdown timeout cut in-flight requests.
    pub async fn cut_off(&self) {
        let mut rx = self.cut.subscribe();
        let _ = rx.wait_for(|&cut| cut).await;
    }
}
