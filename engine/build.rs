//! Build identity for `kiln lock`'s fingerprint:
//! - the engine's source: a sha256 over every file the binary is compiled from (the workspace's
//!   `Cargo.toml` and `Cargo.lock`, the engine's manifest, build script, `src/` and `assets/`), so
//!   a commit that touches only documentation, tests or benches is the same build;
//! - the upstream patch series the build applied (`patches/series` beside the workspace, one patch
//!   file name per line, with each file's sha256). Only builds that apply the series say so
//!   (`$KILN_PATCHES_APPLIED=1`, set by the flake); a plain cargo build compiles the crates
//!   unpatched and records an empty series;
//! - the pinned inputs the build came from (`$KILN_PINNED_INPUTS`, the flake's `name=rev` list;
//!   empty for a cargo build);
//! - the git revision, shown but never compared (`$KILN_GIT_REV` wins, for builds from a source
//!   tarball such as Nix's).

use std::path::Path;
use std::process::Command;

use sha2::{Digest, Sha256};

fn main() {
    println!("cargo:rerun-if-env-changed=KILN_GIT_REV");
    let rev = std::env::var("KILN_GIT_REV")
        .ok()
        .filter(|r| !r.is_empty())
        .or_else(|| {
            let out = Command::new("git")
                .args(["rev-parse", "--short=12", "HEAD"])
                .output()
                .ok()?;
            out.status
                .success()
                .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
        });
    println!(
        "cargo:rustc-env=KILN_GIT_REV={}",
        rev.unwrap_or_else(|| "unknown".into())
    );
    if Path::new("../.git/HEAD").exists() {
        println!("cargo:rerun-if-changed=../.git/HEAD");
    }

    println!("cargo:rustc-env=KILN_SOURCE={}", source_hash());
    println!("cargo:rerun-if-env-changed=KILN_PINNED_INPUTS");
    println!(
        "cargo:rustc-env=KILN_PINNED_INPUTS={}",
        std::env::var("KILN_PINNED_INPUTS").unwrap_or_default()
    );

    let series = Path::new("../patches/series");
    println!("cargo:rerun-if-changed=../patches");
    println!("cargo:rerun-if-env-changed=KILN_PATCHES_APPLIED");
    let applied = std::env::var("KILN_PATCHES_APPLIED").is_ok_and(|v| v == "1");
    let mut listed = Vec::new();
    if let Some(text) = applied
        .then(|| std::fs::read_to_string(series).ok())
        .flatten()
    {
        for name in text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
        {
            let hash = std::fs::read(Path::new("../patches").join(name))
                .map(|b| format!("{:x}", Sha256::digest(&b)))
                .unwrap_or_else(|_| "missing".into());
            listed.push(format!("{name}={hash}"));
        }
    }
    println!("cargo:rustc-env=KILN_PATCHES={}", listed.join(";"));
}

/// The sha256 (first 16 hex digits) of the files the binary is compiled from, each as its path
/// relative to the workspace and its bytes, in path order.
fn source_hash() -> String {
    let roots = [
        "../Cargo.toml",
        "../Cargo.lock",
        "Cargo.toml",
        "build.rs",
        "src",
        "assets",
    ];
    let mut files = Vec::new();
    for r in roots {
        println!("cargo:rerun-if-changed={r}");
        collect(Path::new(r), &mut files);
    }
    files.sort();
    let mut h = Sha256::new();
    for f in &files {
        h.update(f.to_string_lossy().as_bytes());
        h.update([0]);
        h.update(std::fs::read(f).unwrap_or_default());
        h.update([0]);
    }
    format!("{:x}", h.finalize())[..16].to_string()
}

fn collect(path: &Path, out: &mut Vec<std::path::PathBuf>) {
    if path.is_dir() {
        if let Ok(entries) = std::fs::read_dir(path) {
            for e in entries.flatten() {
                collect(&e.path(), out);
            }
        }
    } else if path.is_file() {
        out.push(path.to_path_buf());
    }
}
