//! `kiln bench`: sweep one server (`--url`), compare saved runs, or start kiln with each config of
//! a sweep file and sweep them all.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use kiln::bench::client::Endpoint;
use kiln::bench::prompts::Prompt;
use kiln::bench::run::Progress;
use kiln::bench::{BenchResult, BenchSettings, plot, report};

use super::sweep;

#[derive(clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    #[command(subcommand)]
    command: Option<BenchCommand>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(clap::Subcommand)]
enum BenchCommand {
    /// Print the side-by-side table of saved runs, with ratios to the first (and plot them).
    Compare(CompareArgs),
    /// Start kiln with each config of a TOML file, sweep it, stop it; write the comparison.
    Sweep(sweep::SweepArgs),
}

#[derive(clap::Args)]
pub struct RunArgs {
    /// The server's base URL, e.g. http://127.0.0.1:8000 (kiln, llama-server, vLLM, SGLang, ...).
    #[arg(long)]
    url: Option<String>,
    /// Model id to request [default: the server's first in /v1/models].
    #[arg(long)]
    model: Option<String>,
    /// Bearer token (also $KILN_API_KEY).
    #[arg(long, env = "KILN_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Name of this run in tables and plots [default: the URL].
    #[arg(long)]
    label: Option<String>,
    #[command(flatten)]
    settings: SettingsArgs,
    /// Output stem: writes STEM.json, STEM.md, STEM.png and STEM.svg.
    #[arg(long, default_value = "kiln-bench")]
    out: PathBuf,
}

#[derive(clap::Args, Clone)]
pub struct SettingsArgs {
    /// Concurrency levels (most requests in flight), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    pub concurrency: Vec<usize>,
    /// Requests per level [default: 2*C + 4].
    #[arg(long)]
    pub num_prompts: Option<usize>,
    /// Completion tokens per request.
    #[arg(long, default_value_t = 200)]
    pub max_tokens: u32,
    /// Prompt set: humaneval (coding), bfcl (function calling), mixed, or a .jsonl file of
    /// {"messages": [...]} or {"prompt": "..."} lines.
    #[arg(long, default_value = "mixed")]
    pub dataset: String,
    /// Poisson arrivals at this many requests/s; `inf` sends each level as one burst.
    #[arg(long, default_value = "inf")]
    pub request_rate: f64,
    /// Let the model stop at its end-of-sequence token (default: ignore it, every request
    /// generates max-tokens).
    #[arg(long)]
    pub respect_eos: bool,
    /// Which API to drive.
    #[arg(long, value_enum, default_value = "chat")]
    pub endpoint: Endpoint,
    /// Seconds one request may take before it counts as a timeout error.
    #[arg(long, default_value_t = 600.0)]
    pub request_timeout: f64,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl SettingsArgs {
    /// The settings, and the prompts of `--dataset`.
    pub fn settings(&self) -> anyhow::Result<(BenchSettings, Vec<Prompt>)> {
        anyhow::ensure!(
            !self.request_rate.is_nan() && self.request_rate > 0.0,
            "--request-rate must be positive (or inf)"
        );
        anyhow::ensure!(
            self.request_timeout > 0.0 && self.request_timeout.is_finite(),
            "--request-timeout must be a positive number of seconds"
        );
        anyhow::ensure!(
            !self.concurrency.is_empty() && !self.concurrency.contains(&0),
            "--concurrency levels must each be at least 1"
        );
        anyhow::ensure!(self.max_tokens > 0, "--max-tokens must be at least 1");
        let prompts = kiln::bench::prompts::load(&self.dataset)
            .map_err(|e| anyhow::anyhow!("--dataset: {e}"))?;
        let settings = BenchSettings {
            concurrency: self.concurrency.clone(),
            num_prompts: self.num_prompts.unwrap_or(0),
            max_tokens: self.max_tokens,
            dataset: self.dataset.clone(),
            request_rate: self.request_rate.is_finite().then_some(self.request_rate),
            ignore_eos: !self.respect_eos,
            endpoint: self.endpoint,
            request_timeout_s: self.request_timeout,
            seed: self.seed,
        };
        Ok((settings, prompts))
    }
}

#[derive(clap::Args)]
struct CompareArgs {
    /// Result files of `kiln bench` (or a sweep's JSON, which holds several).
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// Also plot them to STEM.png and STEM.svg.
    #[arg(long)]
    plot: Option<PathBuf>,
}

pub fn run(a: BenchArgs) -> anyhow::Result<()> {
    match a.command {
        Some(BenchCommand::Compare(c)) => compare(c),
        Some(BenchCommand::Sweep(s)) => sweep::run(s),
        None => run_one(a.run),
    }
}

/// A progress bar per level on stderr (hidden when stderr is not a terminal).
pub fn progress_for(label: &str) -> impl Fn(usize) -> Progress + use<> {
    let label = label.to_string();
    move |c: usize| {
        let bar = ProgressBar::new(0);
        bar.set_style(
            ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} requests {elapsed}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar.set_prefix(format!("{label} C={c}"));
        Arc::new(move |done, total| {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
            if done == total {
                bar.finish();
            }
        })
    }
}

pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

fn run_one(a: RunArgs) -> anyhow::Result<()> {
    let url = a
        .url
        .clone()
        .context("give --url URL (a running server), or a subcommand: compare, sweep")?;
    let (settings, prompts) = a.settings.settings()?;
    let label = a.label.clone().unwrap_or_else(|| url.clone());
    let rt = runtime()?;
    let result = rt
        .block_on(kiln::bench::run::run(
            &label,
            &url,
            a.model.clone(),
            a.api_key.clone(),
            &settings,
            &prompts,
            progress_for(&label),
        ))
        .map_err(|e| anyhow::anyhow!(e))?;
    let table = report::table(&result);
    print!("{table}");
    write_outputs(&a.out, &result, &table, std::slice::from_ref(&result))
}

/// STEM.json (the result), STEM.md (the table), STEM.png / STEM.svg (the plot).
pub fn write_outputs(
    stem: &Path,
    json: &impl serde::Serialize,
    table: &str,
    runs: &[BenchResult],
) -> anyhow::Result<()> {
    if let Some(dir) = stem.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let with = |ext: &str| PathBuf::from(format!("{}.{ext}", stem.display()));
    let text = serde_json::to_string_pretty(json).context("serializing results")?;
    std::fs::write(with("json"), text)
        .with_context(|| format!("writing {}", with("json").display()))?;
    std::fs::write(with("md"), table)
        .with_context(|| format!("writing {}", with("md").display()))?;
    plot::write(runs, stem).map_err(|e| anyhow::anyhow!(e))?;
    eprintln!(
        "kiln bench: wrote {}, {}, {}, {}",
        with("json").display(),
        with("md").display(),
        with("png").display(),
        with("svg").display()
    );
    Ok(())
}

/// A `kiln bench` result file or a sweep file, as runs.
pub fn read_runs(path: &Path) -> anyhow::Result<Vec<BenchResult>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    if let Ok(r) = serde_json::from_str::<BenchResult>(&text) {
        return Ok(vec![r]);
    }
    match serde_json::from_str::<kiln::lock::Sweep>(&text) {
        Ok(s) => Ok(s.results()),
        Err(e) => anyhow::bail!(
            "{}: neither a bench result nor a sweep: {e}",
            path.display()
        ),
    }
}

fn compare(c: CompareArgs) -> anyhow::Result<()> {
    let mut runs = Vec::new();
    for f in &c.files {
        runs.extend(read_runs(f)?);
    }
    print!("{}", report::compare(&runs));
    if let Some(stem) = &c.plot {
        plot::write(&runs, stem).map_err(|e| anyhow::anyhow!(e))?;
    }
    Ok(())
}
