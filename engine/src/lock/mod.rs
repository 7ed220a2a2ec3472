//! The production lock: the chosen configuration frozen with its evidence. A lock names the model
//! (and draft) by path and sha256, holds every serve setting, the environment (NCCL_* and the rest),
//! the machine's fingerprint, the benchmark of every tested config, the rejected alternatives and
//! why. `kiln serve --lock` runs exactly it; `kiln doctor --lock` says how the machine drifted.

pub mod fingerprint;
pub mod sweep;

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::bench::{BenchSettings, LevelResult};
pub use fingerprint::{Drift, Fingerprint, Probe, SystemProbe};
pub use sweep::{Sweep, SweepConfig};

pub const LOCK_VERSION: u32 = 1;

/// What `kiln serve --lock` does when the machine has drifted from the lock.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum DriftPolicy {
    /// Serve anyway; the drift shows in the log, /metrics and /ready.
    #[default]
    Warn,
    /// Refuse to start (and, after a failed canary, exit).
    Refuse,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct LockMeta {
    pub version: u32,
    /// Unix seconds.
    pub created: u64,
    /// The chosen config's name in the sweep.
    pub chosen: String,
    pub rationale: String,
    #[serde(default)]
    pub drift_policy: DriftPolicy,
    /// The canary passes at or above `(1 - tolerance)` of the locked output tok/s.
    #[serde(default = "default_tolerance")]
    pub canary_tolerance: f64,
    /// The sweep file the lock was made from.
    #[serde(default)]
    pub sweep: String,
}

fn default_tolerance() -> f64 {
    0.25
}

/// A weight file, pinned.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct ModelRef {
    pub path: PathBuf,
    pub sha256: String,
    pub bytes: u64,
}

/// One tested configuration's settings and numbers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Evidence {
    pub name: String,
    pub serve: toml::Table,
    pub levels: Vec<LevelResult>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Rejected {
    pub name: String,
    pub reason: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Lock {
    pub lock: LockMeta,
    pub model: ModelRef,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draft: Option<ModelRef>,
    /// Every `kiln serve` setting of the chosen config, defaults included (keys as the flags).
    pub serve: toml::Table,
    /// Environment variables the service runs with (NCCL_*, CUDA_*, ...).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    pub fingerprint: Fingerprint,
    pub bench: BenchSettings,
    pub evidence: Vec<Evidence>,
    #[serde(default)]
    pub rejected: Vec<Rejected>,
}

/// Environment variables that change how a run performs, so a sweep records them and a lock
/// pins them.
pub fn relevant_env(all: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    const PREFIXES: [&str; 6] = ["NCCL_", "CUDA_", "KILN_", "OMP_", "RAYON_", "NVIDIA_"];
    all.iter()
        .filter(|(k, _)| PREFIXES.iter().any(|p| k.starts_with(p)))
        .filter(|(k, _)| k.as_str() != "KILN_API_KEY")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// sha256 and size of a file, streamed.
pub fn hash_file(path: &Path) -> std::io::Result<(String, u64)> {
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        total += n as u64;
        h.update(&buf[..n]);
    }
    Ok((format!("{:x}", h.finalize()), total))
}

/// Every file under `dir`, by path relative to it, in path order.
fn files_under(dir: &Path) -> std::io::Result<Vec<std::path::PathBuf>> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d)? {
            let p = entry?.path();
            if std::fs::metadata(&p)?.is_dir() {
                stack.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out.sort();
    Ok(out)
}

/// A model's sha256 and size: a file's own, or for a directory (a Hugging Face model, an
/// EAGLE-3 head) the sha256 of each file's relative path and sha256, one line each in path
/// order, and the files' total size.
pub fn hash_model(path: &Path) -> std::io::Result<(String, u64)> {
    if !std::fs::metadata(path)?.is_dir() {
        return hash_file(path);
    }
    let mut h = Sha256::new();
    let mut total = 0u64;
    for file in files_under(path)? {
        let (sha, bytes) = hash_file(&file)?;
        let rel = file.strip_prefix(path).unwrap_or(&file);
        h.update(format!("{sha}  {}\n", rel.display()).as_bytes());
        total += bytes;
    }
    Ok((format!("{:x}", h.finalize()), total))
}

/// A model's size as [`hash_model`] counts it, without reading it.
pub fn model_bytes(path: &Path) -> std::io::Result<u64> {
    let md = std::fs::metadata(path)?;
    if !md.is_dir() {
        return Ok(md.len());
    }
    files_under(path)?
        .iter()
        .map(|f| std::fs::metadata(f).map(|m| m.len()))
        .sum()
}

impl Lock {
    pub fn read(path: &Path) -> Result<Lock, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let lock: Lock = toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        if lock.lock.version != LOCK_VERSION {
            return Err(format!(
                "{}: lock.version is {}, this kiln reads version {LOCK_VERSION}",
                path.display(),
                lock.lock.version
            ));
        }
        if !(0.0..1.0).contains(&lock.lock.canary_tolerance) {
            return Err(format!(
                "{}: lock.canary-tolerance must be in [0, 1)",
                path.display()
            ));
        }
        Ok(lock)
    }

    pub fn to_toml(&self) -> Result<String, String> {
        toml::to_string_pretty(self).map_err(|e| format!("serializing the lock: {e}"))
    }

    pub fn write(&self, path: &Path) -> Result<(), String> {
        let text = self.to_toml()?;
        std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// The chosen config's own measurements.
    pub fn chosen_evidence(&self) -> Option<&Evidence> {
        self.evidence.iter().find(|e| e.name == self.lock.chosen)
    }
}
