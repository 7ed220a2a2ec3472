//! `kiln bench sweep CONFIGS.toml`: for each named config, start `kiln serve` with it on a free
//! local port, wait for /ready, sweep the concurrency levels, stop it with SIGTERM; then write the
//! comparison (JSON that `kiln lock create` reads, a markdown table, a plot).
//!
//! ```toml
//! [bench]                      # kiln bench settings (keys as the flags)
//! concurrency = [1, 4, 16]
//! max-tokens = 200
//! [serve]                      # kiln serve settings every config shares
//! mode = "fast"
//! [[config]]
//! name = "baseline"
//! [[config]]
//! name = "ngram-adaptive"
//! speculative-algorithm = "ngram"
//! ```

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use kiln::bench::prompts::Prompt;
use kiln::bench::{BenchSettings, report};
use kiln::lock::{Fingerprint, Sweep, SweepConfig, SystemProbe, relevant_env};
use serde::Deserialize;

use super::bench::{progress_for, runtime, write_outputs};
use super::serve::{effective_table, from_table};

#[derive(clap::Args)]
pub struct SweepArgs {
    /// The configs to compare (see `kiln bench sweep --help` for the format).
    file: PathBuf,
    /// Output stem: STEM.json (for `kiln lock create`), STEM.md, STEM.png, STEM.svg, and each
    /// server's log as STEM.NAME.log.
    #[arg(long, default_value = "sweep")]
    out: PathBuf,
    /// Seconds to wait for each server's /ready.
    #[arg(long, default_value_t = 900)]
    ready_timeout: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SweepFile {
    #[serde(default)]
    bench: Option<BenchSettings>,
    #[serde(default)]
    serve: toml::Table,
    config: Vec<toml::Table>,
}

struct Named {
    name: String,
    /// Every serve setting, resolved.
    effective: toml::Table,
    /// The sweep file sets `one-shot-allreduce-max-bytes` for this config (else the measured
    /// crossover is filled in).
    sets_one_shot: bool,
}

const ONE_SHOT_KEY: &str = "one-shot-allreduce-max-bytes";

fn read(path: &Path) -> anyhow::Result<(BenchSettings, Vec<Prompt>, Vec<Named>)> {
    let shown = path.display();
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {shown}"))?;
    let file: SweepFile = toml::from_str(&text).map_err(|e| anyhow::anyhow!("{shown}: {e}"))?;
    let bench = file.bench.unwrap_or_default();
    anyhow::ensure!(
        !bench.concurrency.is_empty() && !bench.concurrency.contains(&0),
        "{shown}: bench.concurrency levels must each be at least 1"
    );
    let prompts = kiln::bench::prompts::load(&bench.dataset)
        .map_err(|e| anyhow::anyhow!("{shown}: bench.dataset: {e}"))?;
    anyhow::ensure!(!file.config.is_empty(), "{shown}: no [[config]] entries");
    let mut named = Vec::new();
    for (i, c) in file.config.into_iter().enumerate() {
        let mut c = c;
        let name = match c.remove("name") {
            Some(toml::Value::String(n)) if !n.is_empty() => n,
            _ => anyhow::bail!("{shown}: config #{} needs a `name` string", i + 1),
        };
        anyhow::ensure!(
            name.chars()
                .all(|ch| ch.is_ascii_alphanumeric() || "-_.".contains(ch)),
            "{shown}: config name `{name}` may hold only letters, digits, '-', '_' and '.'"
        );
        anyhow::ensure!(
            named.iter().all(|n: &Named| n.name != name),
            "{shown}: config `{name}` appears twice"
        );
        let mut merged = file.serve.clone();
        merged.extend(c);
        let sets_one_shot = merged.contains_key(ONE_SHOT_KEY);
        let args = from_table(&merged, &format!("{shown}: config `{name}`"))?;
        let effective =
            effective_table(args).with_context(|| format!("{shown}: config `{name}`"))?;
        named.push(Named {
            name,
            effective,
            sets_one_shot,
        });
    }
    Ok((bench, prompts, named))
}

/// The one-shot crossover over the first `ranks` GPUs (a config with fewer ranks than the box has
/// GPUs: the crossover moves with the rank count); 0 when either sweep fails, said on stderr.
fn measured_crossover(ranks: usize) -> u64 {
    let sweeps = kiln::runner::measure::allreduce_sweep(ranks)
        .and_then(|nccl| Ok((nccl, kiln::runner::measure::one_shot_sweep(ranks)?)));
    match sweeps {
        Ok((nccl, one_shot)) => {
            eprint!(
                "NCCL against the one-shot kernel over {ranks} GPUs\n{}",
                kiln::doctor::allreduce::render_choice(&nccl, &one_shot)
            );
            kiln::doctor::allreduce::one_shot_max_bytes(&nccl, &one_shot)
        }
        Err(e) => {
            eprintln!("kiln: no all-reduce sweeps over {ranks} GPUs, NCCL only there: {e}");
            0
        }
    }
}

fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(l.local_addr()?.port())
}

/// SIGTERM (kiln drains and exits 0), then SIGKILL after a minute.
fn stop(child: &mut Child) {
    if let Ok(pid) = i32::try_from(child.id()) {
        // SAFETY: kill(2) on our own child's pid; no memory is touched.
        unsafe { libc::kill(pid, libc::SIGTERM) };
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
}

async fn wait_ready(
    url: &str,
    child: &mut Child,
    timeout: Duration,
    log: &Path,
) -> anyhow::Result<()> {
    let http = reqwest::Client::new();
    let deadline = Instant::now() + timeout;
    loop {
        let ready = http
            .get(format!("{url}/ready"))
            .timeout(Duration::from_secs(2))
            .send()
            .await;
        if ready.is_ok_and(|r| r.status().is_success()) {
            return Ok(());
        }
        if let Ok(Some(status)) = child.try_wait() {
            anyhow::bail!(
                "kiln serve exited ({status}) before it was ready; see {}",
                log.display()
            );
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "kiln serve was not ready within {}s; see {}",
            timeout.as_secs(),
            log.display()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

pub fn run(a: SweepArgs) -> anyhow::Result<()> {
    let (bench, prompts, configs) = read(&a.file)?;
    let exe = std::env::current_exe().context("finding the kiln binary")?;
    let stem = a.out.clone();
    if let Some(dir) = stem.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let rt = runtime()?;
    let env: std::collections::BTreeMap<String, String> = std::env::vars().collect();
    let mut fingerprint =
        Fingerprint::collect(&SystemProbe::new(env.clone()), &super::doctor::simd_name());
    if fingerprint.gpus.len() >= 2 {
        // The lock keeps the interconnect's numbers so doctor can tell when they fall.
        match kiln::runner::measure::allreduce_sweep(fingerprint.gpus.len()) {
            Ok(points) => {
                eprint!(
                    "all-reduce sweep\n{}",
                    kiln::doctor::allreduce::render(&points)
                );
                fingerprint.allreduce = points;
            }
            Err(e) => eprintln!("kiln: no all-reduce sweep for the lock: {e}"),
        }
        match kiln::runner::measure::one_shot_sweep(fingerprint.gpus.len()) {
            Ok(points) => fingerprint.one_shot = points,
            Err(e) => eprintln!("kiln: no one-shot all-reduce sweep for the lock: {e}"),
        }
        if !fingerprint.allreduce.is_empty() {
            eprint!(
                "NCCL against the one-shot kernel\n{}",
                kiln::doctor::allreduce::render_choice(
                    &fingerprint.allreduce,
                    &fingerprint.one_shot
                )
            );
        }
    }
    // Every config runs (and its evidence, and so the lock, records) the all-reduce this machine
    // measured faster per size at its own rank count, unless the sweep file chose one itself.
    let gpus = fingerprint.gpus.len();
    let mut crossover: std::collections::BTreeMap<usize, u64> = std::collections::BTreeMap::new();
    crossover.insert(
        gpus,
        kiln::doctor::allreduce::one_shot_max_bytes(&fingerprint.allreduce, &fingerprint.one_shot),
    );
    let mut configs = configs;
    for c in &mut configs {
        if c.sets_one_shot {
            continue;
        }
        let ranks = c
            .effective
            .get("tensor-parallel-size")
            .and_then(|v| v.as_integer())
            .map_or(1, |n| n.max(1) as usize);
        let max = if ranks < 2 || ranks > gpus {
            0
        } else {
            *crossover
                .entry(ranks)
                .or_insert_with(|| measured_crossover(ranks))
        };
        c.effective.insert(
            ONE_SHOT_KEY.into(),
            toml::Value::Integer(max.min(i64::MAX as u64) as i64),
        );
    }
    let mut done = Vec::new();
    for c in &configs {
        let port = free_port()?;
        let config_path = PathBuf::from(format!("{}.{}.toml", stem.display(), c.name));
        let mut table = c.effective.clone();
        table.remove("host");
        table.remove("port");
        std::fs::write(
            &config_path,
            toml::to_string(&table).context("rendering a config")?,
        )
        .with_context(|| format!("writing {}", config_path.display()))?;
        let log_path = PathBuf::from(format!("{}.{}.log", stem.display(), c.name));
        let log = std::fs::File::create(&log_path)
            .with_context(|| format!("creating {}", log_path.display()))?;
        let log2 = log.try_clone()?;
        eprintln!("kiln bench sweep: starting `{}` on port {port}", c.name);
        let mut child = Command::new(&exe)
            .arg("serve")
            .arg("--config")
            .arg(&config_path)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .spawn()
            .with_context(|| format!("starting {}", exe.display()))?;
        let url = format!("http://127.0.0.1:{port}");
        let outcome = rt.block_on(async {
            wait_ready(
                &url,
                &mut child,
                Duration::from_secs(a.ready_timeout),
                &log_path,
            )
            .await?;
            kiln::bench::run::run(
                &c.name,
                &url,
                None,
                None,
                &bench,
                &prompts,
                progress_for(&c.name),
            )
            .await
            .map_err(|e| anyhow::anyhow!(e))
        });
        stop(&mut child);
        let result = outcome.with_context(|| format!("config `{}`", c.name))?;
        print!("\n### {}\n\n{}", c.name, report::table(&result));
        done.push(SweepConfig {
            name: c.name.clone(),
            serve: c.effective.clone(),
            result,
        });
    }
    let sweep = Sweep {
        created: kiln::server::state::unix_now(),
        fingerprint,
        env: relevant_env(&env),
        bench,
        configs: done,
    };
    let runs = sweep.results();
    let comparison = report::compare(&runs);
    println!("\n### comparison\n\n{comparison}");
    let mut md = format!(
        "# Sweep of {}\n\n## Comparison\n\n{comparison}",
        a.file.display()
    );
    for r in &runs {
        md.push_str(&format!("\n## {}\n\n{}", r.label, report::table(r)));
    }
    write_outputs(&stem, &sweep, &md, &runs)
}
