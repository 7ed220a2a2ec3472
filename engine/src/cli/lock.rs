//! `kiln lock create`: freeze one config of a sweep, with the evidence.

use std::path::PathBuf;

use kiln::lock::{DriftPolicy, Sweep, hash_model};

#[derive(clap::Args)]
pub struct LockArgs {
    #[command(subcommand)]
    command: LockCommand,
}

#[derive(clap::Subcommand)]
enum LockCommand {
    /// Make a lock from a sweep's JSON (`kiln bench sweep`), choosing one of its configs.
    Create(CreateArgs),
}

#[derive(clap::Args)]
struct CreateArgs {
    /// The sweep file (SWEEP.json written by `kiln bench sweep`).
    #[arg(long = "from")]
    from: PathBuf,
    /// The config to lock, by its name in the sweep.
    #[arg(long)]
    choose: String,
    /// Why this config [default: derived from the numbers].
    #[arg(long)]
    rationale: Option<String>,
    /// What `kiln serve --lock` does on drift.
    #[arg(long, value_enum, default_value = "warn")]
    drift_policy: DriftPolicy,
    /// The canary passes at or above (1 - tolerance) of the locked output tok/s.
    #[arg(long, default_value_t = 0.25)]
    canary_tolerance: f64,
    /// Where to write the lock.
    #[arg(long, short, default_value = "kiln.lock")]
    output: PathBuf,
}

pub fn run(a: LockArgs) -> anyhow::Result<()> {
    let LockCommand::Create(c) = a.command;
    anyhow::ensure!(
        (0.0..1.0).contains(&c.canary_tolerance),
        "--canary-tolerance must be in [0, 1)"
    );
    let sweep = Sweep::read(&c.from).map_err(|e| anyhow::anyhow!(e))?;
    let mut lock = sweep
        .lock(
            &c.choose,
            c.rationale.clone(),
            &c.from.display().to_string(),
            hash_model,
        )
        .map_err(|e| anyhow::anyhow!("{}: {e}", c.from.display()))?;
    lock.lock.drift_policy = c.drift_policy;
    lock.lock.canary_tolerance = c.canary_tolerance;
    lock.write(&c.output).map_err(|e| anyhow::anyhow!(e))?;
    eprintln!(
        "kiln lock: wrote {} (config `{}`, model sha256 {}…)",
        c.output.display(),
        c.choose,
        &lock.model.sha256[..12.min(lock.model.sha256.len())]
    );
    Ok(())
}
