//! Prometheus metrics (`kiln_*`), shared by the HTTP side and the engine thread. Every series carries
//! the `model` and `instance` labels; the registry is served at `/metrics` in the OpenMetrics text
//! format, already while the model loads.

use std::borrow::Cow;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// The route (`/v1/chat/completions`, ...).
    pub endpoint: String,
    /// The HTTP status answered, or `aborted` when the client went away mid-stream.
    pub status: String,
}

/// Draft position within one verification (0 = the first draft token).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PositionLabels {
    pub position: String,
}

/// One `kiln doctor` check of a served lock (`fingerprint`, `drift driver`, `canary`, ...).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CheckLabels {
    pub check: String,
}

/// Batch-size bucket of a step (`1`, `2-4`, `5-16`, `17-64`, `65+`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BatchLabels {
    pub batch: String,
}

impl BatchLabels {
    pub fn of(batch_size: usize) -> BatchLabels {
        let batch = match batch_size {
            0 | 1 => "1",
            2..=4 => "2-4",
            5..=16 => "5-16",
            17..=64 => "17-64",
            _ => "65+",
        };
        BatchLabels {
            batch: batch.to_string(),
        }
    }
}

pub struct Metrics {
    registry: Registry,
    pub spec_draft_tokens: Counter,
    pub spec_accepted_tokens: Counter,
    /// Draft tokens dropped before verification: the sequence's grammar refused them.
    pub spec_grammar_refused_tokens: Counter,
    pub spec_accepted_per_position: Family<PositionLabels, Counter>,
    /// Tokens emitted per verified sequence (accepted drafts + 1), by batch-size bucket.
    pub spec_accept_length: Family<BatchLabels, Histogram>,
    /// K chosen per step, by batch-size bucket.
    pub spec_chosen_k: Family<BatchLabels, Histogram>,
    /// 1 while the adaptive policy has parked the EAGLE-3 draft (drafting did not pay).
    pub spec_draft_parked: Gauge,
    pub requests: Family<RequestLabels, Counter>,
    pub prompt_tokens: Counter,
    pub generation_tokens: Counter,
    pub running: Gauge,
    pub waiting: Gauge,
    pub kv_blocks_used: Gauge,
    pub kv_blocks_total: Gauge,
    pub preemptions: Counter,
    /// Steps launched before the previous step's tokens reached the host (overlap scheduling).
    pub steps_launched_ahead: Counter,
    /// Prompt tokens looked up in the prefix cache, and those found there.
    pub prefix_cache_queried: Counter,
    pub prefix_cache_hits: Counter,
    /// Blocks in the prefix cache, and those given up to make room.
    pub prefix_cache_blocks: Gauge,
    pub prefix_cache_evictions: Counter,
    /// Tokens run through prefill chunks (what a prefix cache hit saves).
    pub prefill_tokens: Counter,
    pub ttft: Histogram,
    pub inter_token: Histogram,
    pub e2e: Histogram,
    pub step_time: Histogram,
    pub batch_size: Histogram,
    pub batch_tokens: Histogram,
    /// 1 once the model is loaded and warmed up.
    pub ready: Gauge,
    /// With `--lock`: 1 for each check that failed (the machine drifted from the lock), 0 for
    /// each that passed.
    pub lock_drift: Family<CheckLabels, Gauge>,
    /// With `--canary`: the canary's output tok/s over the locked number.
    pub canary_ratio: Gauge<f64, std::sync::atomic::AtomicU64>,
}

impl Metrics {
    pub fn new(model: &str, instance: &str) -> Metrics {
        let labels = [
            (Cow::Borrowed("model"), Cow::Owned(model.to_string())),
            (Cow::Borrowed("instance"), Cow::Owned(instance.to_string())),
        ];
        let mut r = Registry::with_prefix_and_labels("kiln", labels.into_iter());
        let latency = || Histogram::new(exponential_buckets(0.001, 2.0, 16));
        fn small() -> Histogram {
            Histogram::new([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0])
        }
        let m = Metrics {
            spec_draft_tokens: Counter::default(),
            spec_accepted_tokens: Counter::default(),
            spec_grammar_refused_tokens: Counter::default(),
            spec_accepted_per_position: Family::default(),
            spec_accept_length: Family::new_with_constructor(small),
            spec_chosen_k: Family::new_with_constructor(small),
            spec_draft_parked: Gauge::default(),
            requests: Family::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            running: Gauge::default(),
            waiting: Gauge::default(),
            kv_blocks_used: Gauge::default(),
            kv_blocks_total: Gauge::default(),
            preemptions: Counter::default(),
            steps_launched_ahead: Counter::default(),
            prefix_cache_queried: Counter::default(),
            prefix_cache_hits: Counter::default(),
            prefix_cache_blocks: Gauge::default(),
            prefix_cache_evictions: Counter::default(),
            prefill_tokens: Counter::default(),
            ttft: latency(),
            inter_token: latency(),
            e2e: Histogram::new(exponential_buckets(0.01, 2.0, 14)),
            step_time: latency(),
            batch_size: Histogram::new(exponential_buckets(1.0, 2.0, 9)),
            batch_tokens: Histogram::new(exponential_buckets(1.0, 2.0, 12)),
            ready: Gauge::default(),
            lock_drift: Family::default(),
            canary_ratio: Gauge::default(),
            registry: Registry::default(),
        };
        r.register(
            "requests",
            "HTTP requests answered, by endpoint and status",
            m.requests.clone(),
        );
        r.register(
            "prompt_tokens",
            "Prompt tokens of admitted requests",
            m.prompt_tokens.clone(),
        );
        r.register(
            "generation_tokens",
            "Tokens generated",
            m.generation_tokens.clone(),
        );
        r.register(
            "running_requests",
            "Sequences in the running batch",
            m.running.clone(),
        );
        r.register(
            "waiting_requests",
            "Sequences waiting for admission",
            m.waiting.clone(),
        );
        r.register(
            "kv_blocks_used",
            "KV cache blocks in use",
            m.kv_blocks_used.clone(),
        );
        r.register(
            "kv_blocks_total",
            "KV cache blocks in the pool",
            m.kv_blocks_total.clone(),
        );
        r.register(
            "preemptions",
            "Sequences that lost their KV cache and recompute",
            m.preemptions.clone(),
        );
        r.register(
            "prefix_cache_queried_tokens",
            "Prompt tokens looked up in the prefix cache",
            m.prefix_cache_queried.clone(),
        );
        r.register(
            "prefix_cache_hit_tokens",
            "Prompt tokens found in the prefix cache (not computed again)",
            m.prefix_cache_hits.clone(),
        );
        r.register(
            "prefix_cache_blocks",
            "KV blocks held in the prefix cache",
            m.prefix_cache_blocks.clone(),
        );
        r.register(
            "prefix_cache_evictions",
            "Cached KV blocks given up to make room",
            m.prefix_cache_evictions.clone(),
        );
        r.register(
            "prefill_tokens",
            "Tokens run through prefill chunks",
            m.prefill_tokens.clone(),
        );
        r.register(
            "steps_launched_ahead",
            "Model steps launched before the previous step's tokens reached the host",
            m.steps_launched_ahead.clone(),
        );
        r.register(
            "time_to_first_token_seconds",
            "Arrival to first generated token",
            m.ttft.clone(),
        );
        r.register(
            "inter_token_latency_seconds",
            "Time between consecutive tokens of one request",
            m.inter_token.clone(),
        );
        r.register(
            "e2e_request_latency_seconds",
            "Arrival to last token",
            m.e2e.clone(),
        );
        r.register(
            "step_duration_seconds",
            "One engine step: schedule, forward, sample",
            m.step_time.clone(),
        );
        r.register(
            "batch_size",
            "Sequences per engine step",
            m.batch_size.clone(),
        );
        r.register(
            "batch_tokens",
            "Tokens per engine step",
            m.batch_tokens.clone(),
        );
        r.register(
            "lock_drift",
            "1 where a check of the served lock failed (drift), 0 where it passed",
            m.lock_drift.clone(),
        );
        r.register(
            "canary_ratio",
            "The canary benchmark's output tok/s over the locked number",
            m.canary_ratio.clone(),
        );
        r.register(
            "model_ready",
            "1 once the model is loaded and warmed up",
            m.ready.clone(),
        );
        r.register(
            "spec_draft_tokens",
            "Draft tokens verified by the target model",
            m.spec_draft_tokens.clone(),
        );
        r.register(
            "spec_accepted_tokens",
            "Draft tokens accepted",
            m.spec_accepted_tokens.clone(),
        );
        r.register(
            "spec_grammar_refused_tokens",
            "Draft tokens dropped before verification because the request's grammar refused them",
            m.spec_grammar_refused_tokens.clone(),
        );
        r.register(
            "spec_accepted_tokens_per_position",
            "Draft tokens accepted, by position in the draft",
            m.spec_accepted_per_position.clone(),
        );
        r.register(
            "spec_accept_length",
            "Tokens emitted per verified sequence (accepted drafts + 1), by batch size",
            m.spec_accept_length.clone(),
        );
        r.register(
            "spec_chosen_k",
            "Draft tokens per sequence chosen for a step, by batch size",
            m.spec_chosen_k.clone(),
        );
        r.register(
            "spec_draft_parked",
            "1 while the adaptive policy has parked the EAGLE-3 draft because drafting did not pay",
            m.spec_draft_parked.clone(),
        );
        Metrics { registry: r, ..m }
    }

    pub fn count_request(&self, endpoint: &str, status: &str) {
        self.requests
            .get_or_create(&RequestLabels {
                endpoint: endpoint.to_string(),
                status: status.to_string(),
            })
            .inc();
    }

    /// The OpenMetrics text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}
