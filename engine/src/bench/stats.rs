//! Per-level summaries of request records: the bench_serving metrics.

use serde::{Deserialize, Serialize};

use super::client::RequestRecord;

/// Mean, median and 99th percentile, in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub mean: f64,
    pub p50: f64,
    pub p99: f64,
}

impl Summary {
    /// From values in seconds; zeros when there are none.
    pub fn of_seconds(values: &[f64]) -> Summary {
        if values.is_empty() {
            return Summary::default();
        }
        let mut v: Vec<f64> = values.iter().map(|x| x * 1e3).collect();
        v.sort_by(f64::total_cmp);
        Summary {
            mean: v.iter().sum::<f64>() / v.len() as f64,
            p50: percentile(&v, 0.50),
            p99: percentile(&v, 0.99),
        }
    }
}

/// Linear interpolation between closest ranks (numpy's default), on sorted values.
fn percentile(sorted: &[f64], q: f64) -> f64 {
    let pos = q * (sorted.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

/// One concurrency level's results.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LevelResult {
    /// Most requests in flight at once.
    pub concurrency: usize,
    /// Poisson arrival rate in requests/s; None: all at once (burst).
    pub request_rate: Option<f64>,
    pub num_prompts: usize,
    pub completed: usize,
    pub failed: usize,
    /// Failed requests by error kind.
    pub errors: std::collections::BTreeMap<String, usize>,
    pub duration_s: f64,
    pub request_throughput: f64,
    pub input_tok_s: f64,
    pub output_tok_s: f64,
    pub total_tok_s: f64,
    pub mean_input_tokens: f64,
    pub mean_output_tokens: f64,
    pub ttft_ms: Summary,
    /// Per request: (e2e - ttft) / (output tokens - 1).
    pub tpot_ms: Summary,
    pub itl_ms: Summary,
    pub e2e_ms: Summary,
    /// Sum of request latencies over the level's wall time.
    pub achieved_concurrency: f64,
    /// Tokens per verified sequence step, from the server's /metrics (speculation only).
    pub accept_length: Option<f64>,
}

impl LevelResult {
    pub fn from_records(
        concurrency: usize,
        request_rate: Option<f64>,
        records: &[RequestRecord],
        duration_s: f64,
    ) -> LevelResult {
        let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.ok).collect();
        let mut errors = std::collections::BTreeMap::new();
        for r in records.iter().filter(|r| !r.ok) {
            let kind = r.error.clone().unwrap_or_else(|| "unknown".into());
            *errors.entry(kind).or_insert(0) += 1;
        }
        let input: u64 = ok.iter().map(|r| r.prompt_tokens).sum();
        let output: u64 = ok.iter().map(|r| r.output_tokens).sum();
        let per_s = |x: f64| {
            if duration_s > 0.0 {
                x / duration_s
            } else {
                0.0
            }
        };
        let ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft).collect();
        let tpot: Vec<f64> = ok
            .iter()
            .filter(|r| r.output_tokens > 1)
            .filter_map(|r| Some((r.e2e - r.ttft?) / (r.output_tokens - 1) as f64))
            .collect();
        let itl: Vec<f64> = ok.iter().flat_map(|r| r.itl.iter().copied()).collect();
        let e2e: Vec<f64> = ok.iter().map(|r| r.e2e).collect();
        let n = ok.len().max(1) as f64;
        LevelResult {
            concurrency,
            request_rate,
            num_prompts: records.len(),
            completed: ok.len(),
            failed: records.len() - ok.len(),
            errors,
            duration_s,
            request_throughput: per_s(ok.len() as f64),
            input_tok_s: per_s(input as f64),
            output_tok_s: per_s(output as f64),
            total_tok_s: per_s((input + output) as f64),
            mean_input_tokens: input as f64 / n,
            mean_output_tokens: output as f64 / n,
            ttft_ms: Summary::of_seconds(&ttft),
            tpot_ms: Summary::of_seconds(&tpot),
            itl_ms: Summary::of_seconds(&itl),
            e2e_ms: Summary::of_seconds(&e2e),
            achieved_concurrency: per_s(records.iter().map(|r| r.e2e).sum()),
            accept_length: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(ok: bool, ttft: f64, e2e: f64, out: u64) -> RequestRecord {
        RequestRecord {
            ok,
            error: (!ok).then(|| "HTTP 500".to_string()),
            prompt_tokens: 10,
            output_tokens: out,
            ttft: ok.then_some(ttft),
            e2e,
            itl: vec![0.01; out.saturating_sub(1) as usize],
        }
    }

    #[test]
    fn level_metrics_follow_bench_serving_definitions() {
        let records = [
            rec(true, 0.1, 1.1, 11),
            rec(true, 0.3, 2.3, 21),
            rec(false, 0.0, 0.5, 0),
        ];
        let l = LevelResult::from_records(2, None, &records, 2.0);
        assert_eq!((l.completed, l.failed), (2, 1));
        assert_eq!(l.errors.get("HTTP 500"), Some(&1));
        assert!((l.output_tok_s - 16.0).abs() < 1e-9);
        assert!((l.input_tok_s - 10.0).abs() < 1e-9);
        assert!((l.request_throughput - 1.0).abs() < 1e-9);
        assert!((l.ttft_ms.mean - 200.0).abs() < 1e-9);
        assert!((l.tpot_ms.mean - 100.0).abs() < 1e-9);
        assert!((l.achieved_concurrency - 1.95).abs() < 1e-9);
        assert!((l.itl_ms.p99 - 10.0).abs() < 1e-9);
    }

    #[test]
    fn percentiles_interpolate() {
        let s = Summary::of_seconds(&[0.001, 0.002, 0.003, 0.004]);
        assert!((s.p50 - 2.5).abs() < 1e-9);
        assert!((s.mean - 2.5).abs() < 1e-9);
        assert!((s.p99 - 3.97).abs() < 1e-9);
        assert_eq!(Summary::of_seconds(&[]), Summary::default());
    }
}
