//! A sweep over concurrency levels against one server: at each level, `num_prompts` requests with
//! at most C in flight, sent all at once (burst) or with Poisson arrivals.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

use super::client::{self, Endpoint, RequestRecord, Target};
use super::prompts::Prompt;
use super::stats::LevelResult;

/// What a bench run does, independent of the server it runs against.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct BenchSettings {
    pub concurrency: Vec<usize>,
    /// Requests per level; 0: 2*C + 4 (enough for a steady state at every C, as loadgen does).
    #[serde(default)]
    pub num_prompts: usize,
    #[serde(default = "default_max_tokens")]
    pub max_tokens: u32,
    /// `humaneval`, `bfcl`, `mixed` or a .jsonl path.
    #[serde(default = "default_dataset")]
    pub dataset: String,
    /// Requests/s with Poisson arrivals; None: burst.
    #[serde(default)]
    pub request_rate: Option<f64>,
    #[serde(default = "default_true")]
    pub ignore_eos: bool,
    #[serde(default = "default_endpoint")]
    pub endpoint: Endpoint,
    #[serde(default = "default_timeout")]
    pub request_timeout_s: f64,
    #[serde(default)]
    pub seed: u64,
}

fn default_max_tokens() -> u32 {
    200
}
fn default_dataset() -> String {
    "mixed".into()
}
fn default_true() -> bool {
    true
}
fn default_endpoint() -> Endpoint {
    Endpoint::Chat
}
fn default_timeout() -> f64 {
    600.0
}

impl Default for BenchSettings {
    fn default() -> Self {
        BenchSettings {
            concurrency: vec![1, 4, 16],
            num_prompts: 0,
            max_tokens: default_max_tokens(),
            dataset: default_dataset(),
            request_rate: None,
            ignore_eos: true,
            endpoint: Endpoint::Chat,
            request_timeout_s: default_timeout(),
            seed: 0,
        }
    }
}

impl BenchSettings {
    pub fn prompts_at(&self, concurrency: usize) -> usize {
        if self.num_prompts > 0 {
            self.num_prompts
        } else {
            2 * concurrency + 4
        }
    }
}

/// One server's results over every level.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BenchResult {
    /// The line's name in tables and plots (a sweep config name, or `--label`).
    pub label: String,
    pub url: String,
    pub model: String,
    pub settings: BenchSettings,
    /// Unix seconds at the start.
    pub started: u64,
    pub levels: Vec<LevelResult>,
}

/// Called after each finished request with (done, total) of the level.
pub type Progress = Arc<dyn Fn(usize, usize) + Send + Sync>;

/// Runs every level in order against `url`, cycling through `prompts` (loaded once by the caller
/// from `settings.dataset`). The model id is the server's first one unless given.
pub async fn run(
    label: &str,
    url: &str,
    model: Option<String>,
    api_key: Option<String>,
    settings: &BenchSettings,
    prompts: &[Prompt],
    on_level: impl Fn(usize) -> Progress,
) -> Result<BenchResult, String> {
    if prompts.is_empty() {
        return Err("no prompts to send".into());
    }
    if settings.concurrency.is_empty() || settings.concurrency.contains(&0) {
        return Err("concurrency levels must be given and each at least 1".into());
    }
    if settings.request_timeout_s.is_nan() || settings.request_timeout_s <= 0.0 {
        return Err("request timeout must be positive".into());
    }
    let mut target = Target {
        url: url.trim_end_matches('/').to_string(),
        model: model.clone().unwrap_or_default(),
        api_key,
        endpoint: settings.endpoint,
        max_tokens: settings.max_tokens,
        ignore_eos: settings.ignore_eos,
        request_timeout: Duration::from_secs_f64(settings.request_timeout_s),
    };
    let http = client::http_client(&target).map_err(|e| format!("HTTP client: {e}"))?;
    if model.is_none() {
        target.model = client::first_model(&http, &target).await?;
    }
    let mut result = BenchResult {
        label: label.to_string(),
        url: target.url.clone(),
        model: target.model.clone(),
        settings: settings.clone(),
        started: crate::server::state::unix_now(),
        levels: Vec::new(),
    };
    let mut offset = 0;
    for &c in &settings.concurrency {
        let n = settings.prompts_at(c);
        let chosen: Vec<Prompt> = (0..n)
            .map(|i| prompts[(offset + i) % prompts.len()].clone())
            .collect();
        offset += n;
        let before = client::accept_length_counters(&http, &target.url).await;
        let mut level = run_level(&http, &target, chosen, c, settings, on_level(c)).await;
        let after = client::accept_length_counters(&http, &target.url).await;
        if let (Some((s0, c0)), Some((s1, c1))) = (before, after) {
            level.accept_length = (c1 > c0).then(|| (s1 - s0) / (c1 - c0));
        }
        result.levels.push(level);
    }
    Ok(result)
}

async fn run_level(
    http: &reqwest::Client,
    target: &Target,
    prompts: Vec<Prompt>,
    concurrency: usize,
    settings: &BenchSettings,
    progress: Progress,
) -> LevelResult {
    let total = prompts.len();
    let slots = Arc::new(Semaphore::new(concurrency));
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(settings.seed ^ concurrency as u64);
    let start = Instant::now();
    let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::with_capacity(total);
    let mut next_arrival = 0.0f64;
    for prompt in prompts {
        if let Some(rate) = settings.request_rate.filter(|r| r.is_finite() && *r > 0.0) {
            // Exponential inter-arrival times: a Poisson process at `rate` requests/s.
            let u: f64 = rng.random_range(f64::EPSILON..1.0);
            next_arrival += -u.ln() / rate;
            let wait = next_arrival - start.elapsed().as_secs_f64();
            if wait > 0.0 {
                tokio::time::sleep(Duration::from_secs_f64(wait)).await;
            }
        }
        let Ok(permit) = slots.clone().acquire_owned().await else {
            break;
        };
        let (http, target, progress, done) =
            (http.clone(), target.clone(), progress.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            let rec = client::send(&http, &target, &prompt).await;
            drop(permit);
            let d = done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            progress(d, total);
            rec
        }));
    }
    let mut records = Vec::with_capacity(total);
    for t in tasks {
        records.push(t.await.unwrap_or_else(|_| RequestRecord {
            error: Some("bench task panicked".into()),
            ..Default::default()
        }));
    }
    let duration = start.elapsed().as_secs_f64();
    LevelResult::from_records(concurrency, settings.request_rate, &records, duration)
}
