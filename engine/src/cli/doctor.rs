//! `kiln doctor`: the preflight checks, and drift from a lock.

use std::path::PathBuf;

use std::cell::RefCell;

use kiln::doctor::allreduce;
use kiln::doctor::{self, DoctorOptions};
use kiln::lock::{Lock, SystemProbe};
use kiln::runner::measure;

#[derive(clap::Args)]
pub struct DoctorArgs {
    /// Compare the machine with this lock's fingerprint, environment and model files.
    #[arg(long)]
    lock: Option<PathBuf>,
    /// Compare model sizes only, not their sha256 (for very large models).
    #[arg(long)]
    skip_model_hash: bool,
    /// Print the checks as JSON.
    #[arg(long)]
    json: bool,
    /// Skip the all-reduce sweep (it runs on machines with 2 or more GPUs and a CUDA build).
    #[arg(long)]
    no_allreduce: bool,
}

/// The CPU kernels' SIMD level, as the fingerprint names it.
pub fn simd_name() -> String {
    kiln::runner::device::cpu_simd_name().to_string()
}

pub fn run(a: DoctorArgs) -> anyhow::Result<()> {
    let lock = match &a.lock {
        Some(p) => Some(Lock::read(p).map_err(|e| anyhow::anyhow!(e))?),
        None => None,
    };
    let probe = SystemProbe::new(std::env::vars().collect());
    let simd = simd_name();
    // Kept to print the whole table after the checks (the check shows two sizes).
    let measured = RefCell::new(Vec::new());
    let sweeper = |n: usize| {
        let points = measure::allreduce_sweep(n)?;
        measured.replace(points.clone());
        Ok(points)
    };
    let one_shot_measured = RefCell::new(Vec::new());
    let one_shot_sweeper = |n: usize| {
        let points = measure::one_shot_sweep(n)?;
        one_shot_measured.replace(points.clone());
        Ok(points)
    };
    let checks = doctor::run(
        &probe,
        &DoctorOptions {
            lock: lock.as_ref(),
            simd: &simd,
            hash_models: !a.skip_model_hash,
            allreduce: (!a.no_allreduce).then_some(&sweeper as &doctor::AllReduceSweeper),
            one_shot: (!a.no_allreduce).then_some(&one_shot_sweeper as &doctor::AllReduceSweeper),
        },
    );
    if a.json {
        println!("{}", serde_json::to_string_pretty(&checks)?);
    } else {
        print!("{}", doctor::render(&checks));
        let points = measured.borrow();
        if !points.is_empty() {
            print!("\nall-reduce sweep\n{}", allreduce::render(&points));
            print!(
                "\nNCCL against the one-shot kernel\n{}",
                allreduce::render_choice(&points, &one_shot_measured.borrow())
            );
        }
    }
    let failed = checks
        .iter()
        .filter(|c| c.status == doctor::Status::Fail)
        .count();
    anyhow::ensure!(
        failed == 0,
        "{failed} check(s) failed{}",
        a.lock
            .as_ref()
            .map(|p| format!(" against {}", p.display()))
            .unwrap_or_default()
    );
    Ok(())
}
