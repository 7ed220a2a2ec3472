//! `kiln doctor`: the preflight checks, and drift from a lock.

use std::path::PathBuf;

use kiln::backend::cpu::simd::SimdLevel;
use kiln::doctor::{self, DoctorOptions};
use kiln::lock::{Lock, SystemProbe};

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
}

/// The CPU kernels' SIMD level, as the fingerprint names it.
pub fn simd_name() -> String {
    match SimdLevel::detect() {
        SimdLevel::Scalar => "scalar",
        SimdLevel::Avx2 => "avx2",
        SimdLevel::Avx512Vnni => "avx512-vnni",
    }
    .to_string()
}

pub fn run(a: DoctorArgs) -> anyhow::Result<()> {
    let lock = match &a.lock {
        Some(p) => Some(Lock::read(p).map_err(|e| anyhow::anyhow!(e))?),
        None => None,
    };
    let probe = SystemProbe::new(std::env::vars().collect());
    let simd = simd_name();
    let checks = doctor::run(
        &probe,
        &DoctorOptions {
            lock: lock.as_ref(),
            simd: &simd,
            hash_models: !a.skip_model_hash,
        },
    );
    if a.json {
        println!("{}", serde_json::to_string_pretty(&checks)?);
    } else {
        print!("{}", doctor::render(&checks));
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
