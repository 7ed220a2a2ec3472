//! `kiln doc`: production.md generated from a lock (template `production.md.j2`), so the document
//! can never disagree with what the service runs.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;
use serde_json::json;

use crate::bench::{BenchResult, report};
use crate::lock::Lock;

const TEMPLATE: &str = include_str!("production.md.j2");

/// One patch of the series, with the `Key: value` lines of its header (What, Why, Upstream,
/// Applies-to, Drop-when, ...).
#[derive(Clone, Debug, Serialize)]
pub struct PatchInfo {
    pub name: String,
    pub sha256: String,
    pub fields: BTreeMap<String, String>,
}

/// Reads `dir/series` and each listed patch's header.
pub fn read_patches(dir: &Path) -> Result<Vec<PatchInfo>, String> {
    let series = dir.join("series");
    let text = match std::fs::read_to_string(&series) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(format!("{}: {e}", series.display())),
    };
    let mut out = Vec::new();
    for name in text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let path = dir.join(name);
        let body = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let (sha256, _) =
            crate::lock::hash_file(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let head = String::from_utf8_lossy(&body);
        let mut fields = BTreeMap::new();
        for line in head.lines() {
            if line.starts_with("---") || line.starts_with("diff ") {
                break;
            }
            if let Some((k, v)) = line.split_once(':') {
                let k = k.trim();
                if !k.is_empty() && !k.contains(' ') && !v.trim().is_empty() {
                    fields.insert(k.to_string(), v.trim().to_string());
                }
            }
        }
        out.push(PatchInfo {
            name: name.to_string(),
            sha256,
            fields,
        });
    }
    Ok(out)
}

/// RFC 3339 UTC (`2026-12-03T14:43:55Z`) from Unix seconds.
pub fn utc_date(secs: u64) -> String {
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs);
    humantime::format_rfc3339_seconds(t).to_string()
}

/// What each serve setting does, for the settings table.
fn why(key: &str) -> &'static str {
    match key {
        "model" => "the weights served (pinned by sha256 below)",
        "served-model-name" => "the model id clients send",
        "host" => "bind address",
        "port" => "TCP port",
        "allowed-origins" => "web origins a browser may call from (CORS); others refused",
        "mode" => "fast: quantized weights and two-level 8-bit activations; exact: f32 throughout",
        "threads" => "compute threads",
        "kv-tokens" => "KV cache size in tokens, shared by all running sequences",
        "mem-fraction-static" => "fraction of the GPU's memory for the weights plus the KV pool",
        "block-size" => "tokens per paged KV block",
        "cuda-graph-max-bs" => "GPU: decode batches up to this size replay recorded CUDA graphs",
        "disable-cuda-graph" => "GPU: every decode step runs eagerly",
        "max-running" => "sequences batched in one step, at most",
        "max-step-tokens" => "tokens per step (decode plus chunked prefill), at most",
        "max-model-len" => "longest prompt + completion",
        "max-queue" => "requests in flight before new ones get 429",
        "max-body-bytes" => "largest request body",
        "header-timeout" => "seconds a connection has to send its request headers",
        "body-timeout" => "seconds a request has to send its body",
        "max-connections" => "connections open at once, at most",
        "max-n" => "largest `n` per request",
        "tensor-parallel-size" => {
            "ranks the model's heads and MLP are split across (one all-reduce per sub-layer)"
        }
        "moe-split" => "how tensor parallelism splits the routed experts: whole experts or columns",
        "one-shot-allreduce-max-bytes" => {
            "GPU: all-reduces up to this size run on the one-shot peer-to-peer kernel, larger on NCCL"
        }
        "tp-collective-timeout" => {
            "seconds a collective waits for a stalled rank before kiln exits to be restarted whole"
        }
        "shutdown-timeout" => "seconds in-flight requests may finish after SIGTERM",
        "no-overlap" => "detokenize on the engine thread (off: overlapped with the next step)",
        "no-prefix-cache" => "prefill every prompt in full (no reuse of cached prefixes)",
        "disable-overlap-schedule" => {
            "plan each step after the previous step's tokens reach the host (GPU)"
        }
        "speculative-algorithm" => "speculative decoding method",
        "speculative-num-steps" => "most draft tokens per sequence per step",
        "speculative-policy" => {
            "adaptive: K per step from measured costs and acceptance; fixed: always S"
        }
        "speculative-ngram-min" => "shortest suffix the n-gram drafter matches",
        "speculative-ngram-max" => "longest suffix the n-gram drafter matches",
        _ => "",
    }
}

fn value_text(v: &toml::Value) -> String {
    match v {
        toml::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// The `kiln serve` flags equivalent to the lock's settings.
fn expanded_command(lock: &Lock) -> String {
    let mut parts = vec!["kiln serve".to_string()];
    for (k, v) in &lock.serve {
        match v {
            toml::Value::Boolean(true) => parts.push(format!("--{k}")),
            toml::Value::Boolean(false) => {}
            other => parts.push(format!("--{k} {}", value_text(other))),
        }
    }
    parts.join(" \\\n  ")
}

fn evidence_runs(lock: &Lock) -> Vec<BenchResult> {
    lock.evidence
        .iter()
        .map(|e| BenchResult {
            label: e.name.clone(),
            url: String::new(),
            model: String::new(),
            settings: lock.bench.clone(),
            started: 0,
            levels: e.levels.clone(),
        })
        .collect()
}

/// The document. `lock_file`: how the document refers to the lock.
/// `instance`: the service's name (`kiln-INSTANCE.service`).
pub fn render(
    lock: &Lock,
    lock_file: &str,
    instance: &str,
    patches: &[PatchInfo],
) -> Result<String, String> {
    let mut env = minijinja::Environment::new();
    env.set_trim_blocks(true);
    env.add_template("production.md", TEMPLATE)
        .map_err(|e| format!("the document template: {e}"))?;
    let runs = evidence_runs(lock);
    let mut patch_keys: Vec<String> = patches
        .iter()
        .flat_map(|p| p.fields.keys().cloned())
        .collect();
    patch_keys.sort();
    patch_keys.dedup();
    let settings: Vec<_> = lock
        .serve
        .iter()
        .map(|(k, v)| json!({"key": k, "value": value_text(v), "why": why(k)}))
        .collect();
    let mut models = vec![
        json!({"role": "model", "path": lock.model.path, "sha256": lock.model.sha256, "bytes": lock.model.bytes}),
    ];
    if let Some(d) = &lock.draft {
        models.push(json!({"role": "draft", "path": d.path, "sha256": d.sha256, "bytes": d.bytes}));
    }
    let get = |k: &str| lock.serve.get(k).map(value_text).unwrap_or_default();
    let model_name = lock
        .serve
        .get("served-model-name")
        .map(value_text)
        .or_else(|| {
            lock.model
                .path
                .file_name()
                .map(|n| n.to_string_lossy().to_string())
        })
        .unwrap_or_else(|| "model".into());
    let prompts_per_level = if lock.bench.num_prompts > 0 {
        format!("{} requests", lock.bench.num_prompts)
    } else {
        "2 x C + 4 requests".to_string()
    };
    let ctx = json!({
        "model_name": model_name,
        "chosen": lock.lock.chosen,
        "lock_file": lock_file,
        "created": utc_date(lock.lock.created),
        "sweep": lock.lock.sweep,
        "rationale": lock.lock.rationale,
        "fp": lock.fingerprint,
        "allreduce": lock.fingerprint.allreduce.iter().map(|p| json!({
            "size": crate::doctor::allreduce::size_label(p.bytes),
            "latency": format!("{:.1}", p.latency_ns as f64 / 1e3),
            "bus": format!("{:.2}", p.bus_mbps as f64 / 1e3),
        })).collect::<Vec<_>>(),
        "settings": settings,
        "expanded": expanded_command(lock),
        "instance": instance,
        "env": lock.env.iter().map(|(k, v)| json!({"key": k, "value": v})).collect::<Vec<_>>(),
        "patches": patches,
        "patch_keys": patch_keys,
        "models": models,
        "bench": lock.bench,
        "prompts_per_level": prompts_per_level,
        "base": runs.first().map(|r| r.label.clone()).unwrap_or_default(),
        "comparison": report::compare(&runs),
        "evidence": runs.iter().map(|r| json!({"name": r.label, "table": report::table(r)})).collect::<Vec<_>>(),
        "rejected": lock.rejected,
        "canary": false,
        "shutdown_timeout": get("shutdown-timeout"),
        "host": get("host"),
        "port": get("port"),
        "drift_policy": match lock.lock.drift_policy { crate::lock::DriftPolicy::Warn => "warn", crate::lock::DriftPolicy::Refuse => "refuse" },
        "tolerance_pct": format!("{:.0}", lock.lock.canary_tolerance * 100.0),
    });
    env.get_template("production.md")
        .and_then(|t| t.render(ctx))
        .map_err(|e| format!("rendering the document: {e}"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn dates_are_civil() {
        assert_eq!(super::utc_date(0), "1970-01-01T00:00:00Z");
        assert_eq!(super::utc_date(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(super::utc_date(1_796_309_035), "2026-12-03T14:43:55Z");
    }

    #[test]
    fn the_locked_interconnect_is_in_the_document() {
        use crate::doctor::allreduce::{AllReducePoint, SWEEP_BYTES};
        let fake_hash = |_: &std::path::Path| Ok(("ab".repeat(32), 1234));
        let mut lock = crate::lock::sweep::tests::sample_sweep()
            .lock("spec", None, "sweep.json", fake_hash)
            .expect("lock");
        let without = super::render(&lock, "kiln.lock", "kiln", &[]).expect("render");
        assert!(!without.contains("all-reduce"), "no GPUs, no sweep section");
        lock.fingerprint.allreduce = SWEEP_BYTES
            .iter()
            .map(|&b| AllReducePoint::measured(b, std::time::Duration::from_millis(10), 8))
            .collect();
        let doc = super::render(&lock, "kiln.lock", "kiln", &[]).expect("render");
        assert!(
            doc.contains("| 64 MiB | 10000.0 us | 11.74 GB/s |"),
            "{doc}"
        );
        assert!(doc.contains("| 4 KiB | 10000.0 us |"), "{doc}");
    }
}
