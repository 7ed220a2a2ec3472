//! `kiln serve`: flags, an optional TOML config file (`--config`, keys named like the flags), and
//! systemd's environment. Flags win over the file; the file wins over the defaults.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use kiln::backend::Precision;
use kiln::backend::TREE_MAX_POSITIONS;
use kiln::catalog::DEFAULT_MODEL;
use kiln::lock::DriftPolicy;
use kiln::runner::{Device, GraphUse, KvSize};
use kiln::server::state::{Canary, LockGuard, ServeOptions};
use kiln::speculation::{SpecConfig, SpecMethod, SpecPolicy};
use serde::{Deserialize, Serialize};

/// The flags that are not settings of a served configuration: where settings come from
/// (`--config`, `--lock`) and how a lock is checked. Never in a TOML file or a lock.
#[derive(clap::Args, Default, Debug, Clone)]
pub struct SourceArgs {
    /// TOML file with any of the settings below (keys as the flag names, e.g. `max-running = 32`).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Run exactly this lock (from `kiln lock create`): its model, settings and environment, after
    /// the doctor's checks against its fingerprint. Only --api-key(-file), --instance,
    /// --drift-policy, --canary and --skip-model-hash may be given with it.
    #[arg(long)]
    lock: Option<PathBuf>,
    /// With --lock, when the machine drifted from it: warn (serve; drift in the log, /metrics and
    /// /ready) or refuse (exit non-zero) [default: the lock's `drift-policy`, else warn].
    #[arg(long, value_enum)]
    drift_policy: Option<DriftPolicy>,
    /// With --lock, after warm-up run a short benchmark at the lock's first concurrency level
    /// and compare its output tok/s with the locked numbers (the lock's `canary-tolerance`).
    #[arg(long)]
    canary: bool,
    /// With --lock, compare the model files' sizes but not their sha256 (for very large models).
    #[arg(long)]
    skip_model_hash: bool,
}

/// Every serve setting, defined once: each field is a flag (`--max-running`), a TOML key of
/// `--config` files and sweep configs (`max-running`), and a key of a lock's `[serve]` table.
/// Merging (flags over a file over [`DEFAULTS`]), the lock's effective table and the flags that
/// conflict with `--lock` all go through the serialized form, so a new setting is one field here,
/// its default in [`DEFAULTS`] and its use in `resolve`.
#[derive(clap::Args, Serialize, Deserialize, Default, Debug, Clone)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ServeArgs {
    #[command(flatten)]
    #[serde(skip)]
    source: SourceArgs,
    /// A .gguf file or a Hugging Face model directory [default: SmolLM2-135M-Instruct from the cache].
    #[arg(long, visible_alias = "model-path")]
    model: Option<PathBuf>,
    /// The model id clients send and /v1/models lists [default: the file name without .gguf].
    #[arg(long)]
    served_model_name: Option<String>,
    /// The model's tool-call format, by SGLang's names: qwen25 (hermes), llama3, mistral,
    /// deepseekv3, deepseekv31, kimi_k2 [default: read from the chat template's markers].
    #[arg(long)]
    tool_call_parser: Option<String>,
    /// Moves a reasoning model's thinking into `reasoning_content`, by SGLang's names:
    /// deepseek-r1, qwen3, qwen3-thinking, kimi (◁think▷), kimi_k2 (Kimi-K2-Thinking's <think>),
    /// glm45 [default: none; the thinking stays in `content`].
    #[arg(long)]
    reasoning_parser: Option<String>,
    /// Address to bind [default: 127.0.0.1; use 0.0.0.0 to listen on every interface].
    #[arg(long)]
    host: Option<String>,
    /// TCP port [default: 8000].
    #[arg(long)]
    port: Option<u16>,
    /// Web origins allowed to call the server from a browser (comma-separated, e.g.
    /// `https://app.example`; `*` for any), answered with CORS headers. A request carrying any
    /// other `Origin` is refused with 403 [default: none: curl and SDKs send no Origin].
    #[arg(long, value_delimiter = ',')]
    allowed_origins: Option<Vec<String>>,
    /// Require `Authorization: Bearer KEY` on the API routes (also $KILN_API_KEY).
    #[arg(long, env = "KILN_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Read the API key from this file (first line), e.g. a systemd credential.
    #[arg(long)]
    api_key_file: Option<PathBuf>,
    /// exact: f32 weights and arithmetic; fast: quantized weights and activations [default: fast].
    #[arg(long, value_enum)]
    mode: Option<Precision>,
    /// Where the model runs: cpu, or cuda (one GPU; refused with the reason where this build or
    /// machine cannot, never a silent CPU fallback) [default: cpu].
    #[arg(long, value_enum)]
    device: Option<Device>,
    /// Compute threads [default: all cores].
    #[arg(long)]
    threads: Option<usize>,
    /// KV cache size in tokens, shared by all running sequences [default: 32768 on the CPU; on
    /// a GPU, what --mem-fraction-static leaves].
    #[arg(long)]
    kv_tokens: Option<usize>,
    /// GPU only (SGLang's meaning): the fraction of the GPU's total memory for the weights plus
    /// the KV pool; the pool gets what the weights leave of it. --kv-tokens wins when given
    /// [default: 0.85].
    #[arg(long)]
    mem_fraction_static: Option<f64>,
    /// GPU only (SGLang's flag): decode steps of up to this many sequences replay CUDA graphs
    /// recorded at start, one per batch-size bucket (1, 2, 4, 8, then every 8) [default: 128].
    #[arg(long)]
    cuda_graph_max_bs: Option<usize>,
    /// GPU only (SGLang's flag): run every decode step eagerly, recording no CUDA graphs.
    #[arg(long)]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    disable_cuda_graph: bool,
    /// Tokens per KV block [default: 16].
    #[arg(long)]
    block_size: Option<usize>,
    /// Sequences batched in one step, at most (SGLang's --max-running-requests) [default: 64].
    #[arg(long, visible_alias = "max-running-requests")]
    max_running: Option<usize>,
    /// Tokens per step, at most: decode tokens plus chunked-prefill tokens. SGLang's
    /// --chunked-prefill-size is accepted for it: there it caps a prefill chunk alone, here the
    /// whole step (a chunk gets what the step's decode tokens leave) [default: 512].
    #[arg(long, visible_alias = "chunked-prefill-size")]
    max_step_tokens: Option<usize>,
    /// Longest prompt + completion [default: the model's context, capped by --kv-tokens].
    /// SGLang's --context-length is accepted for it; it never raises the model's own context,
    /// where SGLang may override it.
    #[arg(long, visible_alias = "context-length")]
    max_model_len: Option<usize>,
    /// Requests running or waiting before new ones get 429 [default: 256].
    #[arg(long)]
    max_queue: Option<usize>,
    /// Largest request body in bytes [default: 4194304].
    #[arg(long)]
    max_body_bytes: Option<usize>,
    /// Seconds a connection has to send a request's headers; silent sockets and keep-alive
    /// connections idle that long are closed [default: 10].
    #[arg(long)]
    header_timeout: Option<u64>,
    /// Seconds a request has to send its whole body [default: 60].
    #[arg(long)]
    body_timeout: Option<u64>,
    /// Connections open at once, at most (kept under the file-descriptor limit); more wait in
    /// the listen queue [default: 1024].
    #[arg(long)]
    max_connections: Option<usize>,
    /// Largest `n` (choices per request) [default: 16].
    #[arg(long)]
    max_n: Option<usize>,
    /// Tensor parallelism: split the model's heads and MLP across this many ranks (threads on the
    /// CPU, each with its share of --threads); its attention heads, KV heads and intermediate size
    /// must divide (or the KV heads be a divisor) [default: 1].
    #[arg(long, visible_aliases = ["tp", "tp-size"])]
    tensor_parallel_size: Option<usize>,
    /// Tensor parallelism over an MoE model: experts (each rank holds whole experts,
    /// expert-parallel) or columns (each rank holds a slice of every expert: balanced at small
    /// batch) [default: experts].
    #[arg(long, value_enum)]
    moe_split: Option<kiln::parallel::MoeSplit>,
    /// GPU tensor parallelism: all-reduces of at most this many bytes run on kiln's one-shot
    /// peer-to-peer kernel, larger ones on NCCL; 0: NCCL only. `kiln lock` measures both and
    /// records the crossover [default: 0].
    #[arg(long)]
    one_shot_allreduce_max_bytes: Option<u64>,
    /// Seconds a tensor-parallel collective may wait for a stalled rank before the group fails
    /// and kiln exits (status 70) for its service manager to restart it whole; it also bounds
    /// the ranks' joining at start. Under a systemd watchdog it must be shorter than WatchdogSec
    /// [default: 45].
    #[arg(long)]
    tp_collective_timeout: Option<u64>,
    /// Seconds to let in-flight requests finish after SIGTERM [default: 30].
    #[arg(long)]
    shutdown_timeout: Option<u64>,
    /// The `instance` label on every metric [default: HOST:PORT].
    #[arg(long)]
    instance: Option<String>,
    /// Detokenize on the engine thread instead of alongside the next step (for comparison;
    /// the detokenization overlap, not the overlap scheduler below).
    #[arg(long)]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    no_overlap: bool,
    /// GPU only (SGLang's flag): the host waits for each step's tokens before planning the
    /// next, instead of launching step N+1 while the GPU runs step N.
    #[arg(long)]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    disable_overlap_schedule: bool,
    /// Prefill every prompt in full instead of reusing the KV blocks of an earlier prompt's
    /// identical prefix (SGLang's --disable-radix-cache is accepted for it).
    #[arg(long, visible_alias = "disable-radix-cache")]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    no_prefix_cache: bool,
    /// Speculative decoding: none; ngram (prompt lookup: drafts continue the latest earlier
    /// occurrence of the last tokens; no draft model); eagle3 (chain drafts from an EAGLE-3 draft
    /// head, --speculative-draft-model-path) [default: none].
    #[arg(long, value_enum)]
    speculative_algorithm: Option<SpecMethod>,
    /// EAGLE-3 draft head: a directory with config.json and model.safetensors, in the SGLang
    /// (`midlayer.*`) or vLLM/speculators (`layers.0.*`) layout.
    #[arg(long)]
    speculative_draft_model_path: Option<PathBuf>,
    /// Most draft tokens per sequence per step; S+1 positions verified [default: 3].
    #[arg(long)]
    speculative_num_steps: Option<usize>,
    /// EAGLE-3 tree speculation: candidates kept per draft step (topk > 1 verifies a token tree
    /// with a tree attention mask; 1 is chain speculation) [default: 1].
    #[arg(long)]
    speculative_eagle_topk: Option<usize>,
    /// EAGLE-3 tree: tokens verified per sequence per step, the current one included (the best
    /// N-1 tree nodes by draft probability) [default: 1 + min(topk * S, 63); chain: S+1].
    #[arg(long)]
    speculative_num_draft_tokens: Option<usize>,
    /// adaptive: each step picks 0..=S draft tokens from measured step costs and acceptance, so
    /// speculation stops where it would lose (large batches); fixed: always S [default: adaptive].
    #[arg(long, value_enum)]
    speculative_policy: Option<SpecPolicy>,
    /// Shortest suffix the n-gram drafter matches [default: 1].
    #[arg(long)]
    speculative_ngram_min: Option<usize>,
    /// Longest suffix the n-gram drafter matches (it tries the longest first) [default: 3].
    #[arg(long)]
    speculative_ngram_max: Option<usize>,
    /// Model cache directory (see `kiln fetch --help`).
    #[arg(long)]
    cache_dir: Option<PathBuf>,
}

fn read_config(path: &Path) -> anyhow::Result<ServeArgs> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    toml::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

/// The default of every setting that has a fixed one (the model, threads, `max-model-len` and
/// the tree's token count are worked out in `resolve`). The one place defaults are written.
const DEFAULTS: &str = r#"
host = "127.0.0.1"
port = 8000
mode = "fast"
device = "cpu"
block-size = 16
cuda-graph-max-bs = 128
max-running = 64
max-step-tokens = 512
max-queue = 256
max-body-bytes = 4194304
header-timeout = 10
body-timeout = 60
max-connections = 1024
max-n = 16
tensor-parallel-size = 1
one-shot-allreduce-max-bytes = 0
tp-collective-timeout = 45
moe-split = "experts"
shutdown-timeout = 30
speculative-algorithm = "none"
speculative-num-steps = 3
speculative-policy = "adaptive"
speculative-eagle-topk = 1
speculative-ngram-min = 1
speculative-ngram-max = 3
"#;

/// Settings only the host gives, never a configuration: they may accompany `--lock`, and a lock
/// does not store them.
const HOST_KEYS: [&str; 3] = ["api-key", "api-key-file", "instance"];

fn defaults() -> anyhow::Result<ServeArgs> {
    toml::from_str(DEFAULTS).context("kiln's built-in serve defaults")
}

fn table(a: &ServeArgs) -> anyhow::Result<toml::Table> {
    toml::Table::try_from(a).context("rendering the serve settings")
}

impl ServeArgs {
    /// `self` with every setting it leaves unset taken from `under` (flags over a file, a file
    /// over the defaults); the source flags stay `self`'s.
    fn over(self, under: &ServeArgs) -> anyhow::Result<ServeArgs> {
        let mut t = table(under)?;
        t.extend(table(&self)?);
        let mut merged = from_table(&t, "the merged serve settings")?;
        merged.source = self.source;
        Ok(merged)
    }
}

/// A setting [`DEFAULTS`] fills, after `--name`'s own check.
fn given<T>(name: &str, v: Option<T>) -> anyhow::Result<T> {
    v.with_context(|| format!("--{name} has no value and no default"))
}

fn positive(name: &str, v: Option<usize>) -> anyhow::Result<usize> {
    match given(name, v)? {
        0 => anyhow::bail!("--{name} must be at least 1"),
        x => Ok(x),
    }
}

fn positive_secs(name: &str, v: Option<u64>) -> anyhow::Result<u64> {
    match given(name, v)? {
        0 => anyhow::bail!("--{name} must be at least 1 second"),
        x => Ok(x),
    }
}

/// `--tp-collective-timeout`, checked against the service's watchdog: a stalled rank must fail
/// its step (answering the requests in it, then exiting 70) before systemd's watchdog kills a
/// process whose engine stopped turning.
fn collective_timeout(secs: Option<u64>, watchdog: Option<Duration>) -> anyhow::Result<Duration> {
    let secs = positive_secs("tp-collective-timeout", secs)?;
    if secs > 86_400 {
        anyhow::bail!(
            "--tp-collective-timeout must be at most 86400 seconds (one day), not {secs}"
        );
    }
    let timeout = Duration::from_secs(secs);
    match watchdog {
        Some(w) if timeout >= w => anyhow::bail!(
            "--tp-collective-timeout ({secs} s) must be shorter than the service's watchdog \
             (WatchdogSec = {} s): a stalled rank must fail its step and exit for a restart \
             before the watchdog kills the process; lower it or raise WatchdogSec",
            w.as_secs()
        ),
        _ => Ok(timeout),
    }
}

fn resolve(a: ServeArgs) -> anyhow::Result<ServeOptions> {
    let a = a.over(&defaults()?)?;
    let model_path = match &a.model {
        Some(p) => p.clone(),
        None => DEFAULT_MODEL.require(&super::cache_dir(a.cache_dir.clone()))?,
    };
    let api_key = match (&a.api_key, &a.api_key_file) {
        (Some(_), Some(_)) => anyhow::bail!("give --api-key or --api-key-file, not both"),
        (Some(k), None) => Some(k.clone()),
        (None, Some(f)) => {
            let text = std::fs::read_to_string(f)
                .with_context(|| format!("reading the API key file {}", f.display()))?;
            let key = text.lines().next().unwrap_or("").trim().to_string();
            anyhow::ensure!(
                !key.is_empty(),
                "{}: the API key file is empty",
                f.display()
            );
            Some(key)
        }
        (None, None) => None,
    };
    if let Some(k) = &api_key {
        anyhow::ensure!(!k.is_empty(), "--api-key must not be empty");
    }
    let host = given("host", a.host.clone())?;
    let port = given("port", a.port)?;
    let block_size = positive("block-size", a.block_size)?;
    let device = given("device", a.device)?;
    if let Some(t) = a.kv_tokens {
        anyhow::ensure!(
            t >= block_size,
            "--kv-tokens ({t}) must hold at least one block ({block_size})"
        );
    }
    let kv = KvSize::choose(device == Device::Cuda, a.kv_tokens, a.mem_fraction_static)?;
    let spec = SpecConfig {
        method: given("speculative-algorithm", a.speculative_algorithm)?,
        num_steps: positive("speculative-num-steps", a.speculative_num_steps)?,
        ngram_min: positive("speculative-ngram-min", a.speculative_ngram_min)?,
        ngram_max: positive("speculative-ngram-max", a.speculative_ngram_max)?,
        adaptive: given("speculative-policy", a.speculative_policy)? == SpecPolicy::Adaptive,
        topk: positive("speculative-eagle-topk", a.speculative_eagle_topk)?,
        num_draft_tokens: 0,
    };
    let mut spec = spec;
    spec.num_draft_tokens = match a.speculative_num_draft_tokens {
        Some(n) => n,
        None if spec.topk > 1 => 1 + (spec.topk * spec.num_steps).min(TREE_MAX_POSITIONS - 1),
        None => spec.num_steps + 1,
    };
    anyhow::ensure!(
        spec.ngram_min <= spec.ngram_max,
        "--speculative-ngram-min ({}) must not exceed --speculative-ngram-max ({})",
        spec.ngram_min,
        spec.ngram_max
    );
    anyhow::ensure!(
        spec.num_steps <= 16,
        "--speculative-num-steps must be at most 16"
    );
    if spec.topk > 1 {
        anyhow::ensure!(
            spec.method == SpecMethod::Eagle3,
            "--speculative-eagle-topk > 1 (tree speculation) needs --speculative-algorithm eagle3"
        );
        anyhow::ensure!(
            (2..=TREE_MAX_POSITIONS).contains(&spec.num_draft_tokens),
            "--speculative-num-draft-tokens ({}) must be in 2..={TREE_MAX_POSITIONS} for a tree",
            spec.num_draft_tokens
        );
        anyhow::ensure!(
            spec.topk * (spec.num_steps - 1) <= TREE_MAX_POSITIONS,
            "--speculative-eagle-topk ({}) x (--speculative-num-steps ({}) - 1) must be at most \
             {TREE_MAX_POSITIONS}: the draft tree's attention mask covers that many positions",
            spec.topk,
            spec.num_steps
        );
    } else if a
        .speculative_num_draft_tokens
        .is_some_and(|n| n != spec.num_steps + 1)
    {
        anyhow::bail!(
            "--speculative-num-draft-tokens must be --speculative-num-steps + 1 ({}) for chain \
             speculation (--speculative-eagle-topk 1)",
            spec.num_steps + 1
        );
    }
    match (spec.method, &a.speculative_draft_model_path) {
        (SpecMethod::Eagle3, None) => anyhow::bail!(
            "--speculative-algorithm eagle3 needs --speculative-draft-model-path (a draft head directory)"
        ),
        (SpecMethod::Eagle3, Some(p)) => anyhow::ensure!(
            p.join("config.json").is_file(),
            "--speculative-draft-model-path {}: no config.json there",
            p.display()
        ),
        (_, Some(_)) => anyhow::bail!(
            "--speculative-draft-model-path is only used with --speculative-algorithm eagle3"
        ),
        (_, None) => {}
    }
    let watchdog = std::env::var("WATCHDOG_USEC")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|&us| us > 0)
        .map(Duration::from_micros);
    Ok(ServeOptions {
        model_path,
        served_model_name: a.served_model_name.clone(),
        reasoning_parser: a
            .reasoning_parser
            .as_deref()
            .map(kiln::server::reasoning::resolve)
            .transpose()
            .map_err(anyhow::Error::msg)?,
        tool_call_parser: match a.tool_call_parser.as_deref() {
            Some(name) => {
                kiln::server::tools::resolve(Some(name), None).map_err(anyhow::Error::msg)?
            }
            None => None,
        },
        instance: a
            .instance
            .clone()
            .unwrap_or_else(|| format!("{host}:{port}")),
        host,
        port,
        allowed_origins: a.allowed_origins.clone().unwrap_or_default(),
        api_key,
        precision: given("mode", a.mode)?,
        device,
        threads: a.threads,
        kv,
        block_size,
        max_running: positive("max-running", a.max_running)?,
        max_step_tokens: positive("max-step-tokens", a.max_step_tokens)?,
        max_model_len: match a.max_model_len {
            Some(0) => anyhow::bail!("--max-model-len must be at least 1"),
            n => n,
        },
        max_queue: positive("max-queue", a.max_queue)?,
        max_body_bytes: positive("max-body-bytes", a.max_body_bytes)?,
        header_timeout: Duration::from_secs(positive_secs("header-timeout", a.header_timeout)?),
        body_timeout: Duration::from_secs(positive_secs("body-timeout", a.body_timeout)?),
        max_connections: positive("max-connections", a.max_connections)?,
        max_n: positive("max-n", a.max_n)?,
        tensor_parallel: positive("tensor-parallel-size", a.tensor_parallel_size)?,
        moe_split: given("moe-split", a.moe_split)?,
        group: kiln::parallel::GroupOptions {
            one_shot_max_bytes: given(
                "one-shot-allreduce-max-bytes",
                a.one_shot_allreduce_max_bytes,
            )?,
        },
        // Only a group waits on collectives: one rank never meets the deadline.
        collective_timeout: collective_timeout(
            a.tp_collective_timeout,
            watchdog.filter(|_| a.tensor_parallel_size.unwrap_or(1) > 1),
        )?,
        shutdown_timeout: Duration::from_secs(given("shutdown-timeout", a.shutdown_timeout)?),
        detok_overlap: !a.no_overlap,
        overlap_schedule: !a.disable_overlap_schedule,
        prefix_cache: !a.no_prefix_cache,
        graphs: if a.disable_cuda_graph {
            GraphUse::Off
        } else {
            GraphUse::Record {
                max_bs: positive("cuda-graph-max-bs", a.cuda_graph_max_bs)?,
            }
        },
        spec,
        draft_model: a.speculative_draft_model_path.clone(),
        notify_socket: std::env::var_os("NOTIFY_SOCKET").map(PathBuf::from),
        watchdog,
        lock: None,
    })
}

/// Settings from a TOML table (a sweep config, a lock's `[serve]`); `source` names it in errors.
pub fn from_table(table: &toml::Table, source: &str) -> anyhow::Result<ServeArgs> {
    ServeArgs::deserialize(toml::Value::Table(table.clone()))
        .map_err(|e| anyhow::anyhow!("{source}: {e}"))
}

/// Every setting `args` resolves to, defaults included, as the table a lock freezes. The API key
/// (a secret), the metrics `instance` label and the cache directory are the host's, not the
/// configuration's, and stay out.
pub fn effective_table(args: ServeArgs) -> anyhow::Result<toml::Table> {
    let o = resolve(args.clone())?;
    let mut filled = args.over(&defaults()?)?;
    // The settings `resolve` works out rather than defaults.
    filled.model = Some(o.model_path.clone());
    filled.threads = Some(o.threads.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    }));
    filled.speculative_num_draft_tokens = Some(o.spec.num_draft_tokens);
    let mut t = table(&filled)?;
    for key in HOST_KEYS.iter().chain(&["cache-dir"]) {
        t.remove(*key);
    }
    Ok(t)
}

/// The flags that may not accompany --lock: every setting the flags give except the host's
/// own, and --config.
fn lock_conflicts(f: &ServeArgs) -> anyhow::Result<Vec<String>> {
    let mut c: Vec<String> = table(f)?
        .keys()
        .filter(|k| !HOST_KEYS.contains(&k.as_str()))
        .map(|k| format!("--{k}"))
        .collect();
    if f.source.config.is_some() {
        c.insert(0, "--config".into());
    }
    Ok(c)
}

/// `--lock`: the lock's settings plus the host's secrets, the environment exported, and the
/// doctor's verdict (refusing to start on drift when the policy says so).
fn locked(flags: ServeArgs, path: &Path) -> anyhow::Result<(ServeArgs, LockGuard)> {
    let lock = kiln::lock::Lock::read(path).map_err(|e| anyhow::anyhow!(e))?;
    let conflicts = lock_conflicts(&flags)?;
    anyhow::ensure!(
        conflicts.is_empty(),
        "--lock {} runs exactly the locked settings; remove {} (or re-lock with them)",
        path.display(),
        conflicts.join(", ")
    );
    let shown = path.display().to_string();
    let mut args = from_table(&lock.serve, &format!("{shown}: [serve]"))?;
    args.api_key = flags.api_key.clone();
    args.api_key_file = flags.api_key_file.clone();
    args.instance = flags.instance.clone();
    anyhow::ensure!(
        args.model.as_deref() == Some(lock.model.path.as_path()),
        "{shown}: serve.model is not model.path"
    );
    for (k, v) in &lock.env {
        if std::env::var_os(k).is_none() {
            // SAFETY: still single-threaded: no runtime or worker thread has started yet.
            unsafe { std::env::set_var(k, v) };
        }
    }
    let env: std::collections::BTreeMap<String, String> = std::env::vars().collect();
    let probe = kiln::lock::SystemProbe::new(env);
    let checks = kiln::doctor::run(
        &probe,
        &kiln::doctor::DoctorOptions {
            lock: Some(&lock),
            simd: &super::doctor::simd_name(),
            hash_models: !flags.source.skip_model_hash,
            allreduce: None,
            one_shot: None,
        },
    );
    let policy = flags.source.drift_policy.unwrap_or(lock.lock.drift_policy);
    let bad: Vec<kiln::doctor::Check> = checks
        .iter()
        .filter(|c| c.status == kiln::doctor::Status::Fail)
        .cloned()
        .collect();
    if !bad.is_empty() {
        eprint!("{}", kiln::doctor::render(&bad));
        anyhow::ensure!(
            policy != DriftPolicy::Refuse,
            "the machine drifted from {shown} and the drift policy is refuse ({} failed checks)",
            bad.len()
        );
        eprintln!("kiln: serving despite the drift from {shown} (drift policy: warn)");
    }
    let canary = if flags.source.canary {
        let expected = lock
            .chosen_evidence()
            .and_then(|e| e.levels.first().cloned());
        let level = expected.with_context(|| {
            format!("{shown}: --canary needs the chosen config's benchmark evidence")
        })?;
        let mut settings = lock.bench.clone();
        settings.concurrency = vec![level.concurrency];
        Some(Canary {
            settings,
            expected_tok_s: level.output_tok_s,
            tolerance: lock.lock.canary_tolerance,
        })
    } else {
        None
    };
    let guard = LockGuard {
        lock_file: shown,
        chosen: lock.lock.chosen.clone(),
        checks,
        refuse: policy == DriftPolicy::Refuse,
        canary,
    };
    Ok((args, guard))
}

pub fn run(flags: ServeArgs) -> anyhow::Result<()> {
    let (args, guard) = match (&flags.source.lock, &flags.source.config) {
        (Some(path), _) => {
            let path = path.clone();
            let (a, g) = locked(flags, &path)?;
            (a, Some(g))
        }
        (None, Some(path)) => {
            let file = read_config(path)?;
            (flags.clone().over(&file)?, None)
        }
        (None, None) => {
            anyhow::ensure!(
                flags.source.drift_policy.is_none()
                    && !flags.source.canary
                    && !flags.source.skip_model_hash,
                "--drift-policy, --canary and --skip-model-hash go with --lock"
            );
            (flags, None)
        }
    };
    let mut opts = resolve(args)?;
    opts.lock = guard;
    if let Some(t) = opts.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(t.max(1))
            .build_global()
            .context("setting up worker threads")?;
    }
    // HTTP, JSON and detokenization need little CPU; the compute threads need the cores.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(kiln::server::run(opts))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_collective_timeout_must_fit_under_the_service_watchdog() {
        let secs = Duration::from_secs;
        assert_eq!(
            collective_timeout(Some(45), Some(secs(60))).ok(),
            Some(secs(45))
        );
        assert_eq!(collective_timeout(Some(300), None).ok(), Some(secs(300)));
        let e = collective_timeout(Some(60), Some(secs(60))).expect_err("not under the watchdog");
        assert!(e.to_string().contains("WatchdogSec = 60 s"), "{e}");
        let e = collective_timeout(Some(0), None).expect_err("zero");
        assert!(e.to_string().contains("--tp-collective-timeout"), "{e}");
        let e = collective_timeout(Some(u64::MAX), None).expect_err("huge");
        assert!(e.to_string().contains("at most 86400"), "{e}");
    }

    #[test]
    fn flags_win_over_the_file_and_unknown_keys_are_errors() {
        let file: ServeArgs =
            toml::from_str("port = 9000\nmax-running = 8\nhost = \"0.0.0.0\"").expect("parse");
        let flags = ServeArgs {
            port: Some(9100),
            ..Default::default()
        };
        let m = flags.over(&file).expect("merge");
        assert_eq!(m.port, Some(9100));
        assert_eq!(m.max_running, Some(8));
        assert_eq!(m.host.as_deref(), Some("0.0.0.0"));
        let err = toml::from_str::<ServeArgs>("max-runing = 8").expect_err("unknown key");
        assert!(err.to_string().contains("max-runing"), "{err}");
    }

    #[test]
    fn defaults_fill_every_setting_that_has_one_and_resolve_from_them_alone() {
        let d = defaults().expect("the built-in defaults parse as settings");
        assert_eq!(d.port, Some(8000));
        assert_eq!(d.device, Some(Device::Cpu));
        let o = resolve(ServeArgs {
            model: Some(PathBuf::from("/m.gguf")),
            ..Default::default()
        })
        .expect("resolve");
        assert_eq!(
            (o.host.as_str(), o.port, o.kv),
            ("127.0.0.1", 8000, KvSize::Tokens(32768))
        );
        assert_eq!(o.spec.num_draft_tokens, o.spec.num_steps + 1);
    }

    #[test]
    fn every_configuration_setting_conflicts_with_a_lock_and_the_host_s_own_do_not() {
        let file: ServeArgs = toml::from_str(
            "port = 9000\nmax-running = 8\nspeculative-draft-model-path = \"/d\"\n\
             api-key = \"k\"\ninstance = \"i\"\ndevice = \"cpu\"",
        )
        .expect("parse");
        let mut c = lock_conflicts(&file).expect("conflicts");
        c.sort();
        let want = [
            "--device",
            "--max-running",
            "--port",
            "--speculative-draft-model-path",
        ];
        assert_eq!(c, want);
    }

    #[test]
    fn the_effective_table_holds_every_default_and_no_host_secret() {
        let args: ServeArgs = toml::from_str(
            "model = \"/m.gguf\"\napi-key = \"secret\"\nmax-running = 8\ncache-dir = \"/c\"",
        )
        .expect("parse");
        let t = effective_table(args).expect("table");
        let d = table(&defaults().expect("defaults")).expect("table");
        for key in d.keys() {
            assert!(t.contains_key(key), "{key} missing from {t:?}");
        }
        assert_eq!(t.get("max-running").and_then(|v| v.as_integer()), Some(8));
        assert!(
            !t.contains_key("api-key") && !t.contains_key("cache-dir"),
            "{t:?}"
        );
        // What a lock stores reads back as the same settings.
        let again = effective_table(from_table(&t, "t").expect("reads back")).expect("table");
        assert_eq!(again, t);
    }
}
