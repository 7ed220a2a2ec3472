//! A sweep's record (what `kiln bench sweep` writes) and the lock made from it.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::{Evidence, Fingerprint, Lock, LockMeta, ModelRef, Rejected};
use crate::bench::{BenchResult, BenchSettings};

/// One named config of a sweep: its resolved serve settings and its results.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SweepConfig {
    pub name: String,
    /// Every serve setting, defaults included (the `model` key is the resolved path).
    pub serve: toml::Table,
    pub result: BenchResult,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Sweep {
    /// Unix seconds.
    pub created: u64,
    pub fingerprint: Fingerprint,
    pub env: BTreeMap<String, String>,
    pub bench: BenchSettings,
    pub configs: Vec<SweepConfig>,
}

impl Sweep {
    pub fn read(path: &Path) -> Result<Sweep, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    pub fn results(&self) -> Vec<BenchResult> {
        self.configs.iter().map(|c| c.result.clone()).collect()
    }

    /// Freezes config `chosen`. `rationale`: the operator's words, else one derived from the
    /// numbers (where the chosen config wins, and by how much it trails where it does not).
    pub fn lock(
        &self,
        chosen: &str,
        rationale: Option<String>,
        sweep_file: &str,
        hash: impl Fn(&Path) -> std::io::Result<(String, u64)>,
    ) -> Result<Lock, String> {
        let names: Vec<&str> = self.configs.iter().map(|c| c.name.as_str()).collect();
        let pick = self
            .configs
            .iter()
            .find(|c| c.name == chosen)
            .ok_or_else(|| {
                format!(
                    "no config `{chosen}` in the sweep (it has: {})",
                    names.join(", ")
                )
            })?;
        let model_of = |key: &str| -> Result<Option<ModelRef>, String> {
            let Some(p) = pick.serve.get(key).and_then(|v| v.as_str()) else {
                return Ok(None);
            };
            let path = Path::new(p);
            let (sha256, bytes) = hash(path).map_err(|e| format!("{p}: {e}"))?;
            Ok(Some(ModelRef {
                path: path.to_path_buf(),
                sha256,
                bytes,
            }))
        };
        let model = model_of("model")?
            .ok_or_else(|| format!("config `{chosen}` has no resolved `model` path"))?;
        let draft = model_of("speculative-draft-model-path")?;
        let rejected = self
            .configs
            .iter()
            .filter(|c| c.name != chosen)
            .map(|c| Rejected {
                name: c.name.clone(),
                reason: versus(&c.result, &pick.result),
            })
            .collect();
        Ok(Lock {
            lock: LockMeta {
                version: super::LOCK_VERSION,
                created: crate::server::state::unix_now(),
                chosen: chosen.to_string(),
                rationale: rationale.unwrap_or_else(|| derived_rationale(self, pick)),
                drift_policy: Default::default(),
                canary_tolerance: super::default_tolerance(),
                sweep: sweep_file.to_string(),
            },
            model,
            draft,
            serve: pick.serve.clone(),
            env: self.env.clone(),
            fingerprint: self.fingerprint.clone(),
            bench: self.bench.clone(),
            evidence: self
                .configs
                .iter()
                .map(|c| Evidence {
                    name: c.name.clone(),
                    serve: c.serve.clone(),
                    levels: c.result.levels.clone(),
                })
                .collect(),
            rejected,
        })
    }
}

/// "at C=1: 80.1 vs 100.0 output tok/s (0.80x); ..." — `other` against `chosen`.
fn versus(other: &BenchResult, chosen: &BenchResult) -> String {
    let parts: Vec<String> = chosen
        .levels
        .iter()
        .filter_map(|l| {
            let o = other
                .levels
                .iter()
                .find(|x| x.concurrency == l.concurrency)?;
            let ratio = if l.output_tok_s > 0.0 {
                o.output_tok_s / l.output_tok_s
            } else {
                0.0
            };
            Some(format!(
                "C={}: {:.1} vs {:.1} output tok/s ({:.2}x){}",
                l.concurrency,
                o.output_tok_s,
                l.output_tok_s,
                ratio,
                if o.failed > 0 {
                    format!(", {} failed", o.failed)
                } else {
                    String::new()
                }
            ))
        })
        .collect();
    format!("against {}: {}", chosen.label, parts.join("; "))
}

fn derived_rationale(sweep: &Sweep, pick: &super::SweepConfig) -> String {
    let results = sweep.results();
    let mut wins = Vec::new();
    let mut trails = Vec::new();
    for l in &pick.result.levels {
        let best = crate::bench::report::best_at(&results, l.concurrency);
        match best {
            Some(b) if b.label == pick.name => wins.push(format!("C={}", l.concurrency)),
            Some(b) => {
                let bl = b.levels.iter().find(|x| x.concurrency == l.concurrency);
                let best_tok = bl.map(|x| x.output_tok_s).unwrap_or(0.0);
                let ratio = if best_tok > 0.0 {
                    l.output_tok_s / best_tok
                } else {
                    0.0
                };
                trails.push(format!(
                    "C={} ({:.2}x of {})",
                    l.concurrency, ratio, b.label
                ));
            }
            None => {}
        }
    }
    let mut s = format!(
        "`{}` has the highest output tok/s of the {} tested configs at {}",
        pick.name,
        sweep.configs.len(),
        if wins.is_empty() {
            "no level".to_string()
        } else {
            wins.join(", ")
        }
    );
    if !trails.is_empty() {
        s.push_str(&format!("; it trails at {}", trails.join(", ")));
    }
    s.push('.');
    s
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::bench::LevelResult;

    fn result(label: &str, tok: &[(usize, f64)]) -> BenchResult {
        BenchResult {
            label: label.into(),
            url: "http://127.0.0.1:1".into(),
            model: "m".into(),
            settings: BenchSettings::default(),
            started: 1,
            levels: tok
                .iter()
                .map(|&(c, t)| LevelResult {
                    concurrency: c,
                    output_tok_s: t,
                    completed: 6,
                    ttft_ms: crate::bench::Summary {
                        mean: 12.5,
                        p50: 11.0,
                        p99: 30.25,
                    },
                    accept_length: (label == "spec").then_some(2.5),
                    ..Default::default()
                })
                .collect(),
        }
    }

    pub fn sample_sweep() -> Sweep {
        let serve = |extra: &str| -> toml::Table {
            toml::from_str(&format!("model = \"/models/m.gguf\"\nport = 8000\n{extra}"))
                .expect("table")
        };
        Sweep {
            created: 1,
            fingerprint: Fingerprint {
                cpu: "AMD EPYC".into(),
                cpu_cores: 2,
                ..Default::default()
            },
            env: [("NCCL_P2P_LEVEL".to_string(), "SYS".to_string())].into(),
            bench: BenchSettings::default(),
            configs: vec![
                SweepConfig {
                    name: "baseline".into(),
                    serve: serve(""),
                    result: result("baseline", &[(1, 80.0), (16, 200.0)]),
                },
                SweepConfig {
                    name: "spec".into(),
                    serve: serve("speculative-algorithm = \"ngram\""),
                    result: result("spec", &[(1, 120.0), (16, 190.0)]),
                },
            ],
        }
    }

    #[test]
    fn lock_round_trips_and_keeps_its_evidence() {
        let sweep = sample_sweep();
        let fake_hash = |_: &Path| Ok(("ab".repeat(32), 1234));
        let mut lock = sweep
            .lock("spec", None, "sweep.json", fake_hash)
            .expect("lock");
        // A GPU box's lock also carries its all-reduce sweep (an array of tables at the end).
        lock.fingerprint.allreduce = crate::doctor::allreduce::SWEEP_BYTES
            .iter()
            .map(|&b| {
                crate::doctor::allreduce::AllReducePoint::measured(
                    b,
                    std::time::Duration::from_micros(20 + (b >> 14)),
                    8,
                )
            })
            .collect();
        assert_eq!(lock.model.sha256, "ab".repeat(32));
        assert_eq!(lock.rejected.len(), 1);
        assert!(
            lock.rejected[0].reason.contains("C=1: 80.0 vs 120.0"),
            "{:?}",
            lock.rejected
        );
        assert!(
            lock.lock.rationale.contains("C=1"),
            "{}",
            lock.lock.rationale
        );
        assert!(
            lock.lock.rationale.contains("trails at C=16"),
            "{}",
            lock.lock.rationale
        );
        let text = lock.to_toml().expect("toml");
        let back: Lock = toml::from_str(&text).expect("parse back");
        assert_eq!(back, lock);
        let dir = std::env::temp_dir().join(format!("kiln-lock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("kiln.lock");
        lock.write(&path).expect("write");
        assert_eq!(Lock::read(&path).expect("read"), lock);
        let err = sweep
            .lock("nope", None, "s", fake_hash)
            .expect_err("unknown config");
        assert!(err.contains("baseline, spec"), "{err}");
        std::fs::write(&path, text.replace("version = 1", "version = 9")).expect("write");
        assert!(
            Lock::read(&path)
                .expect_err("version")
                .contains("lock.version")
        );
        let _ = std::fs::remove_dir_all(dir);
    }
}
