//! Build identity for `kiln lock`'s fingerprint: the git revision (`$KILN_GIT_REV` wins, for builds
//! from a source tarball such as Nix's) and the upstream patch series the build applied
//! (`patches/series` beside the workspace, one patch file name per line, with each file's sha256).
//! Only builds that apply the series say so (`$KILN_PATCHES_APPLIED=1`, set by the flake); a plain
//! cargo build compiles the crates unpatched and records an empty series.

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
