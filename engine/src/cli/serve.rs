//! `kiln serve`: flags, an optional TOML config file (`--config`, keys named like the flags), and
//! systemd's environment. Flags win over the file; the file wins over the defaults.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use kiln::backend::Precision;
use kiln::backend::TREE_MAX_POSITIONS;
use kiln::catalog::DEFAULT_MODEL;
use kiln::lock::DriftPolicy;
use kiln::runner::Device;
use kiln::server::state::{Canary, LockGuard, ServeOptions};
use kiln::speculation::{SpecConfig, SpecMethod, SpecPolicy};
use serde::{Deserialize, Serialize};

#[derive(clap::Args, Serialize, Deserialize, Default, Debug, Clone)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ServeArgs {
    /// TOML file with any of these settings (keys as the flag names, e.g. `max-running = 32`).
    #[arg(long)]
    #[serde(skip)]
    config: Option<PathBuf>,
    /// Run exactly this lock (from `kiln lock create`): its model, settings and environment, after
    /// the doctor's checks against its fingerprint. Only --api-key(-file), --instance,
    /// --drift-policy, --canary and --skip-model-hash may be given with it.
    #[arg(long)]
    #[serde(skip)]
    lock: Option<PathBuf>,
    /// With --lock, when the machine drifted from it: warn (serve; drift in the log, /metrics and
    /// /ready) or refuse (exit non-zero) [default: the lock's `drift-policy`, else warn].
    #[arg(long, value_enum)]
    #[serde(skip)]
    drift_policy: Option<DriftPolicy>,
    /// With --lock, after warm-up run a short benchmark at the lock's first concurrency level
    /// and compare its output tok/s with the locked numbers (the lock's `canary-tolerance`).
    #[arg(long)]
    #[serde(skip)]
    canary: bool,
    /// With --lock, compare the model files' sizes but not their sha256 (for very large models).
    #[arg(long)]
    #[serde(skip)]
    skip_model_hash: bool,
    /// A .gguf file or a Hugging Face model directory [default: SmolLM2-135M-Instruct from the cache].
    #[arg(long)]
    model: Option<PathBuf>,
    /// The model id clients send and /v1/models lists [default: the file name without .gguf].
    #[arg(long)]
    served_model_name: Option<String>,
    /// Address to bind [default: 127.0.0.1; use 0.0.0.0 to listen on every interface].
    #[arg(long)]
    host: Option<String>,
    /// TCP port [default: 8000].
    #[arg(long)]
    port: Option<u16>,
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
    /// KV cache size in tokens, shared by all running sequences [default: 32768].
    #[arg(long)]
    kv_tokens: Option<usize>,
    /// Tokens per KV block [default: 16].
    #[arg(long)]
    block_size: Option<usize>,
    /// Sequences batched in one step, at most [default: 64].
    #[arg(long)]
    max_running: Option<usize>,
    /// Tokens per step, at most: decode tokens plus chunked-prefill tokens [default: 512].
    #[arg(long)]
    max_step_tokens: Option<usize>,
    /// Longest prompt + completion [default: the model's context, capped by --kv-tokens].
    #[arg(long)]
    max_model_len: Option<usize>,
    /// Requests running or waiting before new ones get 429 [default: 256].
    #[arg(long)]
    max_queue: Option<usize>,
    /// Largest request body in bytes [default: 4194304].
    #[arg(long)]
    max_body_bytes: Option<usize>,
    /// Largest `n` (choices per request) [default: 16].
    #[arg(long)]
    max_n: Option<usize>,
    /// Tensor parallelism: split the model's heads and MLP across this many ranks (threads on the
    /// CPU, each with its share of --threads); its attention heads, KV heads and intermediate size
    /// must divide (or the KV heads be a divisor) [default: 1].
    #[arg(long)]
    tensor_parallel_size: Option<usize>,
    /// Seconds to let in-flight requests finish after SIGTERM [default: 30].
    #[arg(long)]
    shutdown_timeout: Option<u64>,
    /// The `instance` label on every metric [default: HOST:PORT].
    #[arg(long)]
    instance: Option<String>,
    /// Detokenize on the engine thread instead of alongside the next step (for comparison).
    #[arg(long)]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    no_overlap: bool,
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

/// `self` with unset fields taken from `file`.
fn merge(flags: ServeArgs, file: ServeArgs) -> ServeArgs {
    ServeArgs {
        config: flags.config,
        lock: flags.lock,
        drift_policy: flags.drift_policy,
        canary: flags.canary,
        skip_model_hash: flags.skip_model_hash,
        model: flags.model.or(file.model),
        served_model_name: flags.served_model_name.or(file.served_model_name),
        host: flags.host.or(file.host),
        port: flags.port.or(file.port),
        api_key: flags.api_key.or(file.api_key),
        api_key_file: flags.api_key_file.or(file.api_key_file),
        mode: flags.mode.or(file.mode),
        device: flags.device.or(file.device),
        threads: flags.threads.or(file.threads),
        kv_tokens: flags.kv_tokens.or(file.kv_tokens),
        block_size: flags.block_size.or(file.block_size),
        max_running: flags.max_running.or(file.max_running),
        max_step_tokens: flags.max_step_tokens.or(file.max_step_tokens),
        max_model_len: flags.max_model_len.or(file.max_model_len),
        max_queue: flags.max_queue.or(file.max_queue),
        max_body_bytes: flags.max_body_bytes.or(file.max_body_bytes),
        max_n: flags.max_n.or(file.max_n),
        tensor_parallel_size: flags.tensor_parallel_size.or(file.tensor_parallel_size),
        shutdown_timeout: flags.shutdown_timeout.or(file.shutdown_timeout),
        instance: flags.instance.or(file.instance),
        no_overlap: flags.no_overlap || file.no_overlap,
        speculative_algorithm: flags.speculative_algorithm.or(file.speculative_algorithm),
        speculative_draft_model_path: flags
            .speculative_draft_model_path
            .or(file.speculative_draft_model_path),
        speculative_num_steps: flags.speculative_num_steps.or(file.speculative_num_steps),
        speculative_policy: flags.speculative_policy.or(file.speculative_policy),
        speculative_eagle_topk: flags.speculative_eagle_topk.or(file.speculative_eagle_topk),
        speculative_num_draft_tokens: flags
            .speculative_num_draft_tokens
            .or(file.speculative_num_draft_tokens),
        speculative_ngram_min: flags.speculative_ngram_min.or(file.speculative_ngram_min),
        speculative_ngram_max: flags.speculative_ngram_max.or(file.speculative_ngram_max),
        cache_dir: flags.cache_dir.or(file.cache_dir),
    }
}

fn positive(name: &str, v: Option<usize>, default: usize) -> anyhow::Result<usize> {
    match v {
        Some(0) => anyhow::bail!("--{name} must be at least 1"),
        Some(x) => Ok(x),
        None => Ok(default),
    }
}

fn resolve(a: ServeArgs) -> anyhow::Result<ServeOptions> {
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
    let host = a.host.clone().unwrap_or_else(|| "127.0.0.1".into());
    let port = a.port.unwrap_or(8000);
    let block_size = positive("block-size", a.block_size, 16)?;
    let kv_tokens = positive("kv-tokens", a.kv_tokens, 32768)?;
    anyhow::ensure!(
        kv_tokens >= block_size,
        "--kv-tokens ({kv_tokens}) must hold at least one block ({block_size})"
    );
    let defaults = SpecConfig::default();
    let spec = SpecConfig {
        method: a.speculative_algorithm.unwrap_or_default(),
        num_steps: positive(
            "speculative-num-steps",
            a.speculative_num_steps,
            defaults.num_steps,
        )?,
        ngram_min: positive(
            "speculative-ngram-min",
            a.speculative_ngram_min,
            defaults.ngram_min,
        )?,
        ngram_max: positive(
            "speculative-ngram-max",
            a.speculative_ngram_max,
            defaults.ngram_max,
        )?,
        adaptive: a.speculative_policy.unwrap_or_default() == SpecPolicy::Adaptive,
        topk: positive("speculative-eagle-topk", a.speculative_eagle_topk, 1)?,
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
        anyhow::ensure!(
            a.tensor_parallel_size.unwrap_or(1) == 1,
            "--speculative-eagle-topk > 1 (tree speculation) runs with --tensor-parallel-size 1 \
             only; chain speculation (topk 1) runs with tensor parallelism"
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
        instance: a
            .instance
            .clone()
            .unwrap_or_else(|| format!("{host}:{port}")),
        host,
        port,
        api_key,
        precision: a.mode.unwrap_or_default(),
        device: a.device.unwrap_or_default(),
        threads: a.threads,
        kv_tokens,
        block_size,
        max_running: positive("max-running", a.max_running, 64)?,
        max_step_tokens: positive("max-step-tokens", a.max_step_tokens, 512)?,
        max_model_len: a.max_model_len,
        max_queue: positive("max-queue", a.max_queue, 256)?,
        max_body_bytes: positive("max-body-bytes", a.max_body_bytes, 4 << 20)?,
        max_n: positive("max-n", a.max_n, 16)?,
        tensor_parallel: positive("tensor-parallel-size", a.tensor_parallel_size, 1)?,
        shutdown_timeout: Duration::from_secs(a.shutdown_timeout.unwrap_or(30)),
        overlap: !a.no_overlap,
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
    let served_model_name = args.served_model_name.clone();
    let mut args = args;
    args.api_key = None;
    args.api_key_file = None;
    let o = resolve(args)?;
    let all_cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let filled = ServeArgs {
        model: Some(o.model_path.clone()),
        served_model_name,
        host: Some(o.host.clone()),
        port: Some(o.port),
        mode: Some(o.precision),
        device: Some(o.device),
        threads: Some(o.threads.unwrap_or(all_cores)),
        kv_tokens: Some(o.kv_tokens),
        block_size: Some(o.block_size),
        max_running: Some(o.max_running),
        max_step_tokens: Some(o.max_step_tokens),
        max_model_len: o.max_model_len,
        max_queue: Some(o.max_queue),
        max_body_bytes: Some(o.max_body_bytes),
        max_n: Some(o.max_n),
        tensor_parallel_size: Some(o.tensor_parallel),
        shutdown_timeout: Some(o.shutdown_timeout.as_secs()),
        no_overlap: !o.overlap,
        speculative_algorithm: Some(o.spec.method),
        speculative_draft_model_path: o.draft_model.clone(),
        speculative_num_steps: Some(o.spec.num_steps),
        speculative_policy: Some(if o.spec.adaptive {
            SpecPolicy::Adaptive
        } else {
            SpecPolicy::Fixed
        }),
        speculative_ngram_min: Some(o.spec.ngram_min),
        speculative_ngram_max: Some(o.spec.ngram_max),
        speculative_eagle_topk: Some(o.spec.topk),
        speculative_num_draft_tokens: Some(o.spec.num_draft_tokens),
        ..Default::default()
    };
    toml::Table::try_from(&filled).context("rendering the settings")
}

/// The flags that may accompany --lock: secrets, the metrics label and the lock's own options.
fn lock_conflicts(f: &ServeArgs) -> Vec<&'static str> {
    let mut c = Vec::new();
    let mut flag = |set: bool, name: &'static str| {
        if set {
            c.push(name);
        }
    };
    flag(f.config.is_some(), "--config");
    flag(f.model.is_some(), "--model");
    flag(f.served_model_name.is_some(), "--served-model-name");
    flag(f.host.is_some(), "--host");
    flag(f.port.is_some(), "--port");
    flag(f.mode.is_some(), "--mode");
    flag(f.device.is_some(), "--device");
    flag(f.threads.is_some(), "--threads");
    flag(f.kv_tokens.is_some(), "--kv-tokens");
    flag(f.block_size.is_some(), "--block-size");
    flag(f.max_running.is_some(), "--max-running");
    flag(f.max_step_tokens.is_some(), "--max-step-tokens");
    flag(f.max_model_len.is_some(), "--max-model-len");
    flag(f.max_queue.is_some(), "--max-queue");
    flag(f.max_body_bytes.is_some(), "--max-body-bytes");
    flag(f.max_n.is_some(), "--max-n");
    flag(f.tensor_parallel_size.is_some(), "--tensor-parallel-size");
    flag(f.shutdown_timeout.is_some(), "--shutdown-timeout");
    flag(f.no_overlap, "--no-overlap");
    flag(f.speculative_algorithm.is_some(), "--speculative-algorithm");
    flag(f.speculative_num_steps.is_some(), "--speculative-num-steps");
    flag(f.speculative_policy.is_some(), "--speculative-policy");
    flag(f.speculative_ngram_min.is_some(), "--speculative-ngram-min");
    flag(f.speculative_ngram_max.is_some(), "--speculative-ngram-max");
    flag(f.cache_dir.is_some(), "--cache-dir");
    c
}

/// `--lock`: the lock's settings plus the host's secrets, the environment exported, and the
/// doctor's verdict (refusing to start on drift when the policy says so).
fn locked(flags: ServeArgs, path: &Path) -> anyhow::Result<(ServeArgs, LockGuard)> {
    let lock = kiln::lock::Lock::read(path).map_err(|e| anyhow::anyhow!(e))?;
    let conflicts = lock_conflicts(&flags);
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
            hash_models: !flags.skip_model_hash,
            allreduce: None,
        },
    );
    let policy = flags.drift_policy.unwrap_or(lock.lock.drift_policy);
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
    let canary = if flags.canary {
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
    let (args, guard) = match (&flags.lock, &flags.config) {
        (Some(path), _) => {
            let path = path.clone();
            let (a, g) = locked(flags, &path)?;
            (a, Some(g))
        }
        (None, Some(path)) => {
            let file = read_config(path)?;
            (merge(flags.clone(), file), None)
        }
        (None, None) => {
            anyhow::ensure!(
                flags.drift_policy.is_none() && !flags.canary && !flags.skip_model_hash,
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
    fn flags_win_over_the_file_and_unknown_keys_are_errors() {
        let file: ServeArgs =
            toml::from_str("port = 9000\nmax-running = 8\nhost = \"0.0.0.0\"").expect("parse");
        let flags = ServeArgs {
            port: Some(9100),
            ..Default::default()
        };
        let m = merge(flags, file);
        assert_eq!(m.port, Some(9100));
        assert_eq!(m.max_running, Some(8));
        assert_eq!(m.host.as_deref(), Some("0.0.0.0"));
        let err = toml::from_str::<ServeArgs>("max-runing = 8").expect_err("unknown key");
        assert!(err.to_string().contains("max-runing"), "{err}");
    }
}
