//! `kiln doctor`: preflight checks of the machine, each pass / warn / fail with the fix, and —
//! given a lock — every way the machine has drifted from what was locked. `kiln serve --lock`
//! runs the same checks at start.

pub mod allreduce;

use serde::{Deserialize, Serialize};

use crate::lock::fingerprint::{self, Fingerprint, Probe};
use crate::lock::{Lock, hash_model, model_bytes};
use allreduce::AllReducePoint;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Pass,
    /// Not needed on this machine (no GPU, one GPU).
    Skip,
    Warn,
    Fail,
}

impl Status {
    pub fn label(self) -> &'static str {
        match self {
            Status::Pass => "pass",
            Status::Skip => "skip",
            Status::Warn => "warn",
            Status::Fail => "FAIL",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Check {
    pub name: String,
    pub status: Status,
    pub detail: String,
    /// What to do about it (for warn and fail).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

fn check(name: &str, status: Status, detail: impl Into<String>, fix: Option<&str>) -> Check {
    Check {
        name: name.to_string(),
        status,
        detail: detail.into(),
        fix: fix.map(str::to_string),
    }
}

pub struct DoctorOptions<'a> {
    pub lock: Option<&'a Lock>,
    /// The CPU kernels' SIMD level name.
    pub simd: &'a str,
    /// Hash the locked model files (slow for very large models; size is always compared).
    pub hash_models: bool,
    /// Measures the all-reduce sweep over the given number of GPUs (the CLI passes NCCL's; tests
    /// a stand-in). None: not measured (`--no-allreduce`, and `kiln serve`'s boot check, which
    /// should not spend seconds of NCCL traffic before every start).
    pub allreduce: Option<&'a AllReduceSweeper<'a>>,
    /// Measures the one-shot peer-to-peer kernel's sweep the same way (the CLI passes the CUDA
    /// backend's). None: not measured; the one-shot check is skipped.
    pub one_shot: Option<&'a AllReduceSweeper<'a>>,
}

/// Runs an all-reduce sweep over `n` GPUs.
pub type AllReduceSweeper<'a> =
    dyn Fn(usize) -> Result<Vec<allreduce::AllReducePoint>, String> + 'a;

/// Every check, in a fixed order. Exit status: non-zero when any is `Fail`.
pub fn run(probe: &dyn Probe, opts: &DoctorOptions) -> Vec<Check> {
    let now = Fingerprint::collect(probe, opts.simd);
    let locked_gpus = opts.lock.map(|l| l.fingerprint.gpus.len()).unwrap_or(0);
    let mut out = Vec::new();
    out.push(devices(&now, locked_gpus));
    out.extend(gpu_stack(probe, &now));
    out.push(cuda_backend(locked_gpus));
    out.push(memlock(&now));
    out.push(simd(&now));
    out.push(p2p(probe, &now));
    let (nccl_check, nccl_points) = allreduce_check(&now, opts);
    out.push(nccl_check);
    out.push(one_shot_check(&now, opts, nccl_points.as_deref()));
    out.extend(nccl_env(probe, opts.lock));
    if let Some(lock) = opts.lock {
        out.extend(models(lock, opts.hash_models));
        out.extend(drift_checks(&lock.fingerprint, &now));
    }
    out
}

pub fn failed(checks: &[Check]) -> bool {
    checks.iter().any(|c| c.status == Status::Fail)
}

fn devices(now: &Fingerprint, locked_gpus: usize) -> Check {
    let n = now.gpus.len();
    if n > 0 && n >= locked_gpus {
        let names = now.gpus.first().cloned().unwrap_or_default();
        return check("devices", Status::Pass, format!("{n} x {names}"), None);
    }
    if locked_gpus > 0 {
        return check(
            "devices",
            Status::Fail,
            format!("the lock was made on {locked_gpus} GPUs, {n} visible"),
            Some(
                "check `nvidia-smi`, the NVIDIA driver, and the unit's DeviceAllow= (the NixOS module allows /dev/nvidia*)",
            ),
        );
    }
    check(
        "devices",
        Status::Skip,
        "no NVIDIA GPU visible: the CPU backend serves",
        None,
    )
}

fn gpu_stack(probe: &dyn Probe, now: &Fingerprint) -> Vec<Check> {
    if now.gpus.is_empty() {
        return ["driver", "cuda", "nccl", "nvidia-persistenced"]
            .iter()
            .map(|n| check(n, Status::Skip, "no GPU", None))
            .collect();
    }
    let mut out = Vec::new();
    out.push(if now.driver.is_empty() {
        check(
            "driver",
            Status::Fail,
            "GPUs listed but no driver version readable",
            Some("reinstall the NVIDIA driver; `cat /proc/driver/nvidia/version`"),
        )
    } else {
        check("driver", Status::Pass, now.driver.clone(), None)
    });
    let major: Option<u32> = now.cuda.split('.').next().and_then(|m| m.parse().ok());
    out.push(match major {
        Some(m) if m >= 13 => check(
            "cuda",
            Status::Pass,
            format!("driver supports CUDA {}", now.cuda),
            None,
        ),
        Some(_) => check(
            "cuda",
            Status::Fail,
            format!(
                "the driver supports CUDA {}, kiln's GPU build needs 13",
                now.cuda
            ),
            Some("upgrade the NVIDIA driver to a CUDA 13 one (580 or newer)"),
        ),
        None => check(
            "cuda",
            Status::Warn,
            "the driver's CUDA version is unknown",
            Some("`nvidia-smi` should print `CUDA Version: 13.x`"),
        ),
    });
    out.push(if now.gpus.len() < 2 {
        check("nccl", Status::Skip, "one GPU: no collectives", None)
    } else if now.nccl.is_empty() {
        check(
            "nccl",
            Status::Fail,
            "libnccl.so.2 not found",
            Some("install NCCL (the Nix package links it), or set NCCL_LIBRARY to its path"),
        )
    } else {
        check("nccl", Status::Pass, format!("NCCL {}", now.nccl), None)
    });
    let active = probe
        .run("systemctl", &["is-active", "nvidia-persistenced"])
        .is_some_and(|s| s.trim() == "active")
        || probe.exists("/var/run/nvidia-persistenced/socket");
    out.push(if active {
        check("nvidia-persistenced", Status::Pass, "active", None)
    } else {
        check(
            "nvidia-persistenced",
            Status::Warn,
            "not running: each start re-initializes the GPUs (slow start, first-request latency)",
            Some("NixOS: hardware.nvidia.nvidiaPersistenced = true; elsewhere: systemctl enable --now nvidia-persistenced"),
        )
    });
    out
}

/// Whether this binary reaches the CUDA driver and libraries itself (by dlopen, as serving will),
/// beyond what `nvidia-smi` says.
fn cuda_backend(locked_gpus: usize) -> Check {
    // A lock made on GPUs needs the CUDA side; without one, what is missing is only noted.
    let missing = |otherwise| {
        if locked_gpus > 0 {
            Status::Fail
        } else {
            otherwise
        }
    };
    #[cfg(feature = "cuda")]
    {
        match crate::backend::cuda::probe() {
            Ok(r) if !r.devices.is_empty() && r.nvrtc && r.cublas && r.cublaslt => {
                check("cuda-backend", Status::Pass, r.summary(), None)
            }
            Ok(r) => check(
                "cuda-backend",
                missing(Status::Warn),
                r.summary(),
                Some(
                    "the flake's packages.cuda wraps kiln with NVRTC, cuBLAS and NCCL on LD_LIBRARY_PATH; elsewhere install them or put their lib folders on it",
                ),
            ),
            Err(e) => check("cuda-backend", missing(Status::Skip), e, None),
        }
    }
    #[cfg(not(feature = "cuda"))]
    check(
        "cuda-backend",
        missing(Status::Skip),
        "this build has no CUDA side",
        Some(
            "build with `cargo build --release --features cuda`, or use the flake's packages.cuda",
        ),
    )
}

fn memlock(now: &Fingerprint) -> Check {
    if now.memlock == "unlimited" {
        return check("memlock", Status::Pass, "unlimited", None);
    }
    let status = if now.gpus.is_empty() {
        Status::Warn
    } else {
        Status::Fail
    };
    check(
        "memlock",
        status,
        format!(
            "locked-memory limit is {} bytes: pinned buffers and NCCL need it unlimited",
            now.memlock
        ),
        Some(
            "LimitMEMLOCK=infinity in the unit (the NixOS module sets it), or `ulimit -l unlimited`",
        ),
    )
}

fn simd(now: &Fingerprint) -> Check {
    if now.simd == "scalar" {
        check(
            "cpu-simd",
            Status::Warn,
            "no AVX2: the CPU kernels run scalar code",
            Some("run on an x86-64 CPU with AVX2 (AVX-512 VNNI is fastest)"),
        )
    } else {
        check(
            "cpu-simd",
            Status::Pass,
            format!("{} ({} cores)", now.simd, now.cpu_cores),
            None,
        )
    }
}

fn p2p(probe: &dyn Probe, now: &Fingerprint) -> Check {
    if now.gpus.len() < 2 {
        return check("pcie-p2p", Status::Skip, "fewer than 2 GPUs", None);
    }
    let cmdline = probe.read("/proc/cmdline").unwrap_or_default();
    let passthrough = cmdline.split_whitespace().any(|w| {
        matches!(
            w,
            "iommu=pt" | "amd_iommu=off" | "intel_iommu=off" | "iommu=off"
        )
    });
    let through_cpu = now.gpu_topology.contains("SYS");
    match (passthrough, through_cpu) {
        (true, false) => check(
            "pcie-p2p",
            Status::Pass,
            "IOMMU in passthrough; GPUs share PCIe switches",
            None,
        ),
        (true, true) => check(
            "pcie-p2p",
            Status::Warn,
            "some GPU pairs cross the CPU interconnect (SYS in `nvidia-smi topo -m`)",
            Some(
                "expected on dual-socket boxes; keep each tensor-parallel group on one socket if the model fits",
            ),
        ),
        (false, _) => check(
            "pcie-p2p",
            Status::Warn,
            "IOMMU not in passthrough: PCIe peer-to-peer between GPUs may be routed through the root complex or disabled",
            Some(
                "add iommu=pt (amd_iommu=on iommu=pt / intel_iommu=on iommu=pt) to the kernel command line and disable ACS on the PCIe switches; verify with all-reduce bandwidth in `kiln doctor`",
            ),
        ),
    }
}

/// The lock's `one-shot-allreduce-max-bytes` (0: NCCL only, also when it does not set it).
fn locked_one_shot_max(lock: Option<&Lock>) -> u64 {
    lock.and_then(|l| l.serve.get("one-shot-allreduce-max-bytes"))
        .and_then(|v| v.as_integer())
        .map_or(0, |v| v.max(0) as u64)
}

/// Measures the one-shot kernel, picks the sizes it should serve against NCCL's sweep, and
/// compares that with what the lock serves.
fn one_shot_check(
    now: &Fingerprint,
    opts: &DoctorOptions,
    nccl: Option<&[AllReducePoint]>,
) -> Check {
    const NAME: &str = "one-shot-allreduce";
    let n = now.gpus.len();
    if n < 2 {
        return check(NAME, Status::Skip, "fewer than 2 GPUs", None);
    }
    let (Some(sweep), Some(nccl)) = (opts.one_shot, nccl) else {
        return check(
            NAME,
            Status::Skip,
            "not measured (needs the NCCL sweep too)",
            None,
        );
    };
    let locked = locked_one_shot_max(opts.lock);
    let points = match sweep(n) {
        Ok(p) => p,
        Err(e) => {
            // A lock that serves on the kernel cannot start without it.
            let status = if locked > 0 {
                Status::Fail
            } else {
                Status::Warn
            };
            return check(
                NAME,
                status,
                format!("the one-shot kernel's sweep over {n} GPUs failed: {e}"),
                Some(
                    "serve with --one-shot-allreduce-max-bytes 0 (NCCL only) until peer-to-peer works",
                ),
            );
        }
    };
    let chosen = allreduce::one_shot_max_bytes(nccl, &points);
    let serves = |max: u64| match max {
        0 => "NCCL at every size".to_string(),
        m => format!("the one-shot kernel up to {}", allreduce::size_label(m)),
    };
    match opts.lock {
        Some(_) if chosen != locked => check(
            NAME,
            Status::Warn,
            format!(
                "the lock serves {}; measured now, {} would be faster",
                serves(locked),
                serves(chosen)
            ),
            Some(
                "re-lock (`kiln lock`) to serve the faster choice, or set one-shot-allreduce-max-bytes in the lock's [serve]",
            ),
        ),
        _ => check(
            NAME,
            Status::Pass,
            format!("serves {}", serves(chosen)),
            None,
        ),
    }
}

/// Measures the interconnect with the sweeper and compares it with the lock's sweep; also hands
/// back the points, which the one-shot check compares against.
fn allreduce_check(
    now: &Fingerprint,
    opts: &DoctorOptions,
) -> (Check, Option<Vec<AllReducePoint>>) {
    let n = now.gpus.len();
    if n < 2 {
        return (
            check("allreduce", Status::Skip, "fewer than 2 GPUs", None),
            None,
        );
    }
    let Some(sweep) = opts.allreduce else {
        return (check("allreduce", Status::Skip, "not measured", None), None);
    };
    let locked = opts
        .lock
        .map(|l| l.fingerprint.allreduce.as_slice())
        .unwrap_or_default();
    match sweep(n) {
        Ok(points) => {
            let c = allreduce::compare(&points, locked);
            (c, Some(points))
        }
        Err(e) => (
            check(
                "allreduce",
                // A lock that depends on collectives cannot serve without them.
                if locked.is_empty() {
                    Status::Warn
                } else {
                    Status::Fail
                },
                format!("the all-reduce sweep over {n} GPUs failed: {e}"),
                Some(
                    "run with NCCL_DEBUG=INFO to see which transport or rank fails; `kiln doctor` without a lock reports the rest",
                ),
            ),
            None,
        ),
    }
}

fn nccl_env(probe: &dyn Probe, lock: Option<&Lock>) -> Vec<Check> {
    let env = probe.env();
    let current: Vec<(&String, &String)> =
        env.iter().filter(|(k, _)| k.starts_with("NCCL_")).collect();
    let Some(lock) = lock else {
        let detail = if current.is_empty() {
            "no NCCL_* variables set".to_string()
        } else {
            current
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        return vec![check("nccl-env", Status::Pass, detail, None)];
    };
    let mut out = Vec::new();
    for (k, v) in lock.env.iter() {
        match env.get(k) {
            Some(now) if now == v => {}
            // `kiln serve --lock` exports the lock's environment itself, so an unset variable is
            // not drift; a different value is.
            None => {}
            Some(now) => out.push(check(
                &format!("env {k}"),
                Status::Fail,
                format!("locked {v}, now {now}"),
                Some("unset it (the lock's value applies) or re-run the sweep with the new value"),
            )),
        }
    }
    for (k, v) in current {
        if !lock.env.contains_key(k) {
            out.push(check(
                &format!("env {k}"),
                Status::Warn,
                format!("{k}={v} is set but not in the lock"),
                Some("unset it, or re-run the sweep with it set so its effect is measured"),
            ));
        }
    }
    if out.is_empty() {
        out.push(check(
            "nccl-env",
            Status::Pass,
            format!("{} locked variables match", lock.env.len()),
            None,
        ));
    }
    out
}

fn models(lock: &Lock, hash: bool) -> Vec<Check> {
    let mut out = Vec::new();
    for (what, m) in [("model", Some(&lock.model)), ("draft", lock.draft.as_ref())] {
        let Some(m) = m else { continue };
        let shown = m.path.display();
        let c = match model_bytes(&m.path) {
            Err(e) => check(
                what,
                Status::Fail,
                format!("{shown}: {e}"),
                Some("restore the locked file, or re-lock with the new one"),
            ),
            Ok(bytes) if bytes != m.bytes => check(
                what,
                Status::Fail,
                format!("{shown}: {bytes} bytes, locked {}", m.bytes),
                Some(
                    "the file was replaced: restore the locked one, or re-run the sweep and re-lock",
                ),
            ),
            Ok(_) if !hash => check(
                what,
                Status::Pass,
                format!("{shown}: size matches (hash not checked)"),
                None,
            ),
            Ok(_) => match hash_model(&m.path) {
                Ok((sha, _)) if sha == m.sha256 => {
                    check(what, Status::Pass, format!("{shown}: sha256 matches"), None)
                }
                Ok((sha, _)) => check(
                    what,
                    Status::Fail,
                    format!("{shown}: sha256 {sha}, locked {}", m.sha256),
                    Some(
                        "the file changed: restore the locked one, or re-run the sweep and re-lock",
                    ),
                ),
                Err(e) => check(what, Status::Fail, format!("{shown}: {e}"), None),
            },
        };
        out.push(c);
    }
    out
}

fn drift_fix(field: &str) -> &'static str {
    match field {
        "kiln-version" | "source" | "patches" | "inputs" => {
            "kiln was upgraded or rebuilt: re-run `kiln bench sweep` and re-lock, or roll back to the locked build"
        }
        "driver" | "cuda" | "nccl" => {
            "the GPU stack changed, so the NCCL tuning may no longer hold: re-run the sweep and re-lock, or roll back"
        }
        "memlock" => "LimitMEMLOCK=infinity in the unit",
        "kernel" => {
            "the kernel changed: check the P2P / ACS / IOMMU parameters, then re-run the sweep"
        }
        _ => "different hardware from the lock's: re-run the sweep on this machine",
    }
}

fn drift_checks(locked: &Fingerprint, now: &Fingerprint) -> Vec<Check> {
    let d = fingerprint::drift(locked, now);
    if d.is_empty() {
        return vec![check("fingerprint", Status::Pass, "matches the lock", None)];
    }
    d.into_iter()
        .map(|x| {
            check(
                &format!("drift {}", x.field),
                Status::Fail,
                format!("locked `{}`, now `{}`", x.locked, x.now),
                Some(drift_fix(&x.field)),
            )
        })
        .collect()
}

/// The checks as an aligned table, one line each, with the fix on the next line.
pub fn render(checks: &[Check]) -> String {
    let width = checks.iter().map(|c| c.name.len()).max().unwrap_or(0);
    let mut s = String::new();
    for c in checks {
        s.push_str(&format!(
            "{:<4}  {:<width$}  {}\n",
            c.status.label(),
            c.name,
            c.detail
        ));
        if let (Some(fix), Status::Warn | Status::Fail) = (&c.fix, c.status) {
            s.push_str(&format!("      {:<width$}  fix: {fix}\n", ""));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lock::fingerprint::tests::{FakeProbe, gpu_box};

    fn statuses(checks: &[Check]) -> Vec<(String, Status)> {
        checks.iter().map(|c| (c.name.clone(), c.status)).collect()
    }

    #[test]
    fn a_cpu_machine_passes_with_gpu_checks_skipped() {
        let mut p = FakeProbe::default();
        p.files.insert(
            "/proc/self/limits".into(),
            "Max locked memory  unlimited  unlimited  bytes\n".into(),
        );
        let c = run(
            &p,
            &DoctorOptions {
                lock: None,
                simd: "avx2",
                hash_models: false,
                allreduce: None,
                one_shot: None,
            },
        );
        assert!(!failed(&c), "{}", render(&c));
        let s = statuses(&c);
        assert!(s.contains(&("devices".into(), Status::Skip)));
        assert!(s.contains(&("memlock".into(), Status::Pass)));
    }

    #[test]
    fn the_allreduce_sweep_runs_on_two_or_more_gpus_only() {
        let p = gpu_box();
        let asked = std::cell::Cell::new(0);
        let good = |n: usize| {
            asked.set(n);
            Ok(allreduce::SWEEP_BYTES
                .iter()
                .map(|&b| {
                    allreduce::AllReducePoint::measured(b, std::time::Duration::from_micros(30), n)
                })
                .collect())
        };
        let run_with = |p: &FakeProbe, sweeper: Option<&AllReduceSweeper>| {
            run(
                p,
                &DoctorOptions {
                    lock: None,
                    simd: "avx512vnni",
                    hash_models: false,
                    allreduce: sweeper,
                    one_shot: None,
                },
            )
            .into_iter()
            .find(|c| c.name == "allreduce")
            .expect("an allreduce check")
        };
        let c = run_with(&p, Some(&good));
        assert_eq!(c.status, Status::Pass, "{}", c.detail);
        assert_eq!(asked.get(), 2, "one rank per GPU of the box");
        assert!(c.detail.contains("64 MiB"), "{}", c.detail);
        let broken = |_: usize| Err("ncclCommInitRank: unhandled system error".to_string());
        let c = run_with(&p, Some(&broken));
        assert_eq!(c.status, Status::Warn);
        assert!(c.detail.contains("unhandled system error"), "{}", c.detail);
        assert_eq!(run_with(&p, None).status, Status::Skip);
        asked.set(0);
        let c = run_with(&FakeProbe::default(), Some(&good));
        assert_eq!((c.status, asked.get()), (Status::Skip, 0));
    }

    #[test]
    fn the_one_shot_check_reports_the_measured_choice_against_the_lock() {
        let p = gpu_box();
        let sweep = |latency: fn(u64) -> f64| {
            move |n: usize| -> Result<Vec<AllReducePoint>, String> {
                Ok(allreduce::SWEEP_BYTES
                    .iter()
                    .map(|&b| {
                        let t = std::time::Duration::from_secs_f64(latency(b) * 1e-6);
                        AllReducePoint::measured(b, t, n)
                    })
                    .collect())
            }
        };
        let nccl = sweep(|b| 30.0 + b as f64 / 20e3);
        // The kernel wins up to 16 KiB, then pushing 7 copies loses to NCCL's ring.
        let one_shot = sweep(|b| if b <= 16 << 10 { 7.0 } else { 1e3 });
        let broken = |_: usize| Err("GPU 1 cannot write GPU 0's memory peer-to-peer".to_string());
        let check_with = |lock: Option<&Lock>, one_shot: &AllReduceSweeper| {
            run(
                &p,
                &DoctorOptions {
                    lock,
                    simd: "avx512vnni",
                    hash_models: false,
                    allreduce: Some(&nccl),
                    one_shot: Some(one_shot),
                },
            )
            .into_iter()
            .find(|c| c.name == "one-shot-allreduce")
            .expect("a one-shot check")
        };
        let c = check_with(None, &one_shot);
        assert_eq!(c.status, Status::Pass, "{}", c.detail);
        assert!(c.detail.contains("up to 16 KiB"), "{}", c.detail);
        // A lock made when NCCL served everything: the faster choice is pointed out.
        let mut lock = crate::lock::sweep::tests::sample_sweep()
            .lock("spec", None, "sweep.json", |_| Ok(("ab".repeat(32), 1)))
            .expect("lock");
        lock.serve.insert(
            "one-shot-allreduce-max-bytes".into(),
            toml::Value::Integer(0),
        );
        let c = check_with(Some(&lock), &one_shot);
        assert_eq!(c.status, Status::Warn, "{}", c.detail);
        assert!(c.detail.contains("NCCL at every size"), "{}", c.detail);
        // The lock serves on the kernel and peer-to-peer broke: it cannot serve as locked.
        lock.serve.insert(
            "one-shot-allreduce-max-bytes".into(),
            toml::Value::Integer(16 << 10),
        );
        assert_eq!(check_with(Some(&lock), &one_shot).status, Status::Pass);
        let c = check_with(Some(&lock), &broken);
        assert_eq!(c.status, Status::Fail, "{}", c.detail);
        assert!(c.detail.contains("peer-to-peer"), "{}", c.detail);
    }

    #[test]
    fn a_gpu_box_without_persistenced_or_memlock_gets_fixes() {
        let mut p = gpu_box();
        p.files.insert(
            "/proc/self/limits".into(),
            "Max locked memory  8388608  8388608  bytes\n".into(),
        );
        let c = run(
            &p,
            &DoctorOptions {
                lock: None,
                simd: "avx512vnni",
                hash_models: false,
                allreduce: None,
                one_shot: None,
            },
        );
        let s = statuses(&c);
        assert!(s.contains(&("memlock".into(), Status::Fail)));
        assert!(s.contains(&("nvidia-persistenced".into(), Status::Warn)));
        assert!(s.contains(&("pcie-p2p".into(), Status::Warn)));
        assert!(s.contains(&("cuda".into(), Status::Pass)));
        assert!(render(&c).contains("fix: LimitMEMLOCK=infinity"));
        p.programs.insert(
            "systemctl is-active nvidia-persistenced".into(),
            "active\n".into(),
        );
        p.files
            .insert("/proc/cmdline".into(), "quiet amd_iommu=on iommu=pt".into());
        let c = run(
            &p,
            &DoctorOptions {
                lock: None,
                simd: "avx512vnni",
                hash_models: false,
                allreduce: None,
                one_shot: None,
            },
        );
        let s = statuses(&c);
        assert!(s.contains(&("nvidia-persistenced".into(), Status::Pass)));
        assert!(s.contains(&("pcie-p2p".into(), Status::Pass)));
    }
}
