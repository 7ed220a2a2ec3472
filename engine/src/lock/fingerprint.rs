//! The environment fingerprint a lock freezes, collected through a [`Probe`] so tests can stand in
//! for the machine, and compared field by field to say what drifted.

use std::collections::BTreeMap;
use std::process::Command;

use serde::{Deserialize, Serialize};

/// Where the fingerprint's facts come from: the real machine ([`SystemProbe`]) or a test double.
pub trait Probe {
    /// A file's text (`/proc/cpuinfo`, `/proc/driver/nvidia/version`, ...), None if unreadable.
    fn read(&self, path: &str) -> Option<String>;
    /// A program's stdout when it exits 0 (`nvidia-smi`, `ldconfig`, `systemctl`), else None.
    fn run(&self, program: &str, args: &[&str]) -> Option<String>;
    /// The process environment, as captured by the command line.
    fn env(&self) -> &BTreeMap<String, String>;
    /// Whether a path exists.
    fn exists(&self, path: &str) -> bool;
}

/// The machine kiln runs on.
pub struct SystemProbe {
    env: BTreeMap<String, String>,
}

impl SystemProbe {
    /// `env`: the variables to consider (the CLI passes `std::env::vars()`; the library reads none).
    pub fn new(env: BTreeMap<String, String>) -> SystemProbe {
        SystemProbe { env }
    }
}

impl Probe for SystemProbe {
    fn read(&self, path: &str) -> Option<String> {
        std::fs::read_to_string(path).ok()
    }
    fn run(&self, program: &str, args: &[&str]) -> Option<String> {
        let out = Command::new(program).args(args).output().ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }
    fn env(&self) -> &BTreeMap<String, String> {
        &self.env
    }
    fn exists(&self, path: &str) -> bool {
        std::path::Path::new(path).exists()
    }
}

/// Everything about the machine and the build that a locked configuration's numbers depend on.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct Fingerprint {
    pub kiln_version: String,
    /// Shown, never compared: a commit that leaves the engine's source alone is the same build.
    pub git_rev: String,
    /// The engine's source: a hash of every file the binary is compiled from (build.rs).
    #[serde(default)]
    pub source: String,
    /// Upstream patches compiled in: `name=sha256`, in series order.
    pub patches: Vec<String>,
    /// The pinned inputs the build came from (the flake's `nixpkgs=REV;crane=REV`; empty for a
    /// cargo build).
    #[serde(default)]
    pub inputs: String,
    pub cpu: String,
    pub cpu_cores: usize,
    /// The SIMD level the CPU kernels run at (avx512-vnni, avx2, scalar).
    pub simd: String,
    pub kernel: String,
    /// One entry per GPU this process may use (`CUDA_VISIBLE_DEVICES`, when set), e.g.
    /// `NVIDIA RTX PRO 6000 Blackwell Server Edition`.
    pub gpus: Vec<String>,
    /// `nvidia-smi topo -m`'s matrix (how the GPUs reach each other), empty without GPUs.
    pub gpu_topology: String,
    pub driver: String,
    pub cuda: String,
    pub nccl: String,
    /// Soft RLIMIT_MEMLOCK: `unlimited` or bytes.
    pub memlock: String,
    /// The all-reduce sweep over every GPU when the lock was made (2 or more GPUs and a CUDA
    /// build). Measured, so never compared exactly: doctor's `allreduce` check allows noise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allreduce: Vec<crate::doctor::allreduce::AllReducePoint>,
    /// The one-shot peer-to-peer kernel's sweep (sizes up to 1 MiB) beside NCCL's: the evidence
    /// for the lock's `one-shot-allreduce-max-bytes`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub one_shot: Vec<crate::doctor::allreduce::AllReducePoint>,
}

/// The fields of a fingerprint that drift compares, in a fixed order, as (name, value) text.
/// The build is its version, source, patch series and pinned inputs; its git revision is not
/// compared (a documentation-only commit changes the revision and nothing that runs).
pub fn fields(f: &Fingerprint) -> Vec<(&'static str, String)> {
    vec![
        ("kiln-version", f.kiln_version.clone()),
        ("source", f.source.clone()),
        ("patches", f.patches.join(";")),
        ("inputs", f.inputs.clone()),
        ("cpu", f.cpu.clone()),
        ("cpu-cores", f.cpu_cores.to_string()),
        ("simd", f.simd.clone()),
        ("kernel", f.kernel.clone()),
        ("gpus", f.gpus.join(";")),
        ("gpu-topology", f.gpu_topology.clone()),
        ("driver", f.driver.clone()),
        ("cuda", f.cuda.clone()),
        ("nccl", f.nccl.clone()),
        ("memlock", f.memlock.clone()),
    ]
}

/// One field that differs from the lock.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Drift {
    pub field: String,
    pub locked: String,
    pub now: String,
}

/// Every field of `now` that differs from `locked`.
pub fn drift(locked: &Fingerprint, now: &Fingerprint) -> Vec<Drift> {
    fields(locked)
        .into_iter()
        .zip(fields(now))
        .filter(|(a, b)| a.1 != b.1)
        .map(|(a, b)| Drift {
            field: a.0.to_string(),
            locked: a.1,
            now: b.1,
        })
        .collect()
}

/// The build's own identity, compiled in by build.rs.
pub fn build_patches() -> Vec<String> {
    env!("KILN_PATCHES")
        .split(';')
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

impl Fingerprint {
    /// Reads the machine through `probe`. Facts that cannot be read are empty strings: a machine
    /// without GPUs has no driver, and that is itself a fingerprint.
    pub fn collect(probe: &dyn Probe, simd: &str) -> Fingerprint {
        let cpuinfo = probe.read("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_default();
        let cpu_cores = cpuinfo
            .lines()
            .filter(|l| l.starts_with("processor"))
            .count();
        let kernel = probe
            .read("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_string())
            .unwrap_or_default();
        let smi = |args: &[&str]| probe.run("nvidia-smi", args);
        // The GPUs this process may use: a service given GPUs 0-3 of eight (and the sweep run
        // for it) records those four, so two instances splitting a box each match their lock.
        let visible = probe
            .env()
            .get("CUDA_VISIBLE_DEVICES")
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty());
        let name_query = ["--query-gpu=name", "--format=csv,noheader"];
        let gpus: Vec<String> = match &visible {
            Some(v) => smi(&[&name_query[..], &["-i", v]].concat()),
            None => smi(&name_query),
        }
        .map(|s| {
            s.lines()
                .map(|l| l.trim().to_string())
                .filter(|l| !l.is_empty())
                .collect()
        })
        .unwrap_or_default();
        let driver = smi(&["--query-gpu=driver_version", "--format=csv,noheader"])
            .and_then(|s| s.lines().next().map(|l| l.trim().to_string()))
            .or_else(|| {
                let v = probe.read("/proc/driver/nvidia/version")?;
                let line = v.lines().next()?;
                let at = line.find("Kernel Module")?;
                line[at + "Kernel Module".len()..]
                    .split_whitespace()
                    .next()
                    .map(str::to_string)
            })
            .unwrap_or_default();
        let cuda = smi(&[])
            .and_then(|s| {
                let at = s.find("CUDA Version:")?;
                s[at + "CUDA Version:".len()..]
                    .split_whitespace()
                    .next()
                    .map(str::to_string)
            })
            .unwrap_or_default();
        let gpu_topology = if gpus.len() > 1 {
            smi(&["topo", "-m"])
                .map(|s| {
                    s.lines()
                        .filter(|l| l.starts_with("GPU"))
                        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
                        .collect::<Vec<_>>()
                        .join("\n")
                })
                .unwrap_or_default()
        } else {
            String::new()
        };
        Fingerprint {
            kiln_version: env!("CARGO_PKG_VERSION").to_string(),
            git_rev: env!("KILN_GIT_REV").to_string(),
            source: env!("KILN_SOURCE").to_string(),
            patches: build_patches(),
            inputs: env!("KILN_PINNED_INPUTS").to_string(),
            cpu,
            cpu_cores,
            simd: simd.to_string(),
            kernel,
            gpus,
            gpu_topology,
            driver,
            cuda,
            nccl: nccl_version(probe),
            memlock: memlock(probe),
            allreduce: Vec::new(),
            one_shot: Vec::new(),
        }
    }
}

/// libnccl's version from the dynamic linker's cache (`libnccl.so.2.27.7`), or `$NCCL_LIBRARY`'s.
fn nccl_version(probe: &dyn Probe) -> String {
    let from_name = |name: &str| {
        let at = name.find("libnccl.so.")?;
        let v = name[at + "libnccl.so.".len()..].split_whitespace().next()?;
        (v.matches('.').count() >= 2).then(|| v.to_string())
    };
    if let Some(v) = probe.env().get("NCCL_LIBRARY").and_then(|p| from_name(p)) {
        return v;
    }
    probe
        .run("ldconfig", &["-p"])
        .and_then(|s| s.lines().find_map(from_name))
        .unwrap_or_default()
}

/// The soft locked-memory limit from `/proc/self/limits`.
fn memlock(probe: &dyn Probe) -> String {
    probe
        .read("/proc/self/limits")
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("Max locked memory"))?;
            line["Max locked memory".len()..]
                .split_whitespace()
                .next()
                .map(str::to_string)
        })
        .unwrap_or_default()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A machine made of strings.
    #[derive(Default, Clone)]
    pub struct FakeProbe {
        pub files: BTreeMap<String, String>,
        pub programs: BTreeMap<String, String>,
        pub env: BTreeMap<String, String>,
    }

    impl Probe for FakeProbe {
        fn read(&self, path: &str) -> Option<String> {
            self.files.get(path).cloned()
        }
        fn run(&self, program: &str, args: &[&str]) -> Option<String> {
            self.programs
                .get(format!("{program} {}", args.join(" ")).trim())
                .cloned()
        }
        fn env(&self) -> &BTreeMap<String, String> {
            &self.env
        }
        fn exists(&self, path: &str) -> bool {
            self.files.contains_key(path)
        }
    }

    #[test]
    fn only_the_visible_gpus_are_recorded() {
        let mut p = gpu_box();
        let gpu = "NVIDIA RTX PRO 6000 Blackwell Server Edition";
        p.programs.insert(
            "nvidia-smi --query-gpu=name --format=csv,noheader -i 1".into(),
            format!("{gpu}\n"),
        );
        p.env.insert("CUDA_VISIBLE_DEVICES".into(), "1".into());
        assert_eq!(Fingerprint::collect(&p, "avx2").gpus, [gpu]);
        p.env.remove("CUDA_VISIBLE_DEVICES");
        assert_eq!(Fingerprint::collect(&p, "avx2").gpus.len(), 2);
    }

    /// Two RTX PRO 6000s, driver 580, CUDA 13.0, NCCL 2.27.7, memlock unlimited.
    pub fn gpu_box() -> FakeProbe {
        let mut p = FakeProbe::default();
        let f = |k: &str, v: &str| (k.to_string(), v.to_string());
        p.files.extend([
            f(
                "/proc/cpuinfo",
                "processor\t: 0\nmodel name\t: AMD EPYC 9555\nprocessor\t: 1\nmodel name\t: AMD EPYC 9555\n",
            ),
            f("/proc/sys/kernel/osrelease", "6.12.41\n"),
            f(
                "/proc/self/limits",
                "Max locked memory         unlimited            unlimited            bytes\n",
            ),
        ]);
        let gpu = "NVIDIA RTX PRO 6000 Blackwell Server Edition";
        p.programs.extend([
            f(
                "nvidia-smi --query-gpu=name --format=csv,noheader",
                &format!("{gpu}\n{gpu}\n"),
            ),
            f(
                "nvidia-smi --query-gpu=driver_version --format=csv,noheader",
                "580.95.05\n580.95.05\n",
            ),
            f(
                "nvidia-smi",
                "| NVIDIA-SMI 580.95.05  Driver Version: 580.95.05  CUDA Version: 13.0 |\n",
            ),
            f(
                "nvidia-smi topo -m",
                "\tGPU0\tGPU1\nGPU0\t X \tNODE\nGPU1\tNODE\t X \n",
            ),
            f(
                "ldconfig -p",
                "\tlibnccl.so.2.27.7 (libc6,x86-64) => /usr/lib/libnccl.so.2.27.7\n",
            ),
        ]);
        p
    }

    #[test]
    fn collects_every_field_from_the_probe() {
        let fp = Fingerprint::collect(&gpu_box(), "avx512-vnni");
        assert_eq!(fp.cpu, "AMD EPYC 9555");
        assert_eq!(fp.cpu_cores, 2);
        assert_eq!(fp.kernel, "6.12.41");
        assert_eq!(fp.gpus.len(), 2);
        assert_eq!(fp.driver, "580.95.05");
        assert_eq!(fp.cuda, "13.0");
        assert_eq!(fp.nccl, "2.27.7");
        assert_eq!(fp.memlock, "unlimited");
        assert_eq!(fp.gpu_topology, "GPU0 X NODE\nGPU1 NODE X");
        assert!(drift(&fp, &fp).is_empty());
    }

    #[test]
    fn each_changed_fact_is_reported_as_exactly_its_field() {
        let base = gpu_box();
        let locked = Fingerprint::collect(&base, "avx512-vnni");
        type Change = Box<dyn Fn(&mut FakeProbe)>;
        let set_prog = |k: &'static str, v: &'static str| -> Change {
            Box::new(move |p: &mut FakeProbe| {
                p.programs.insert(k.into(), v.into());
            })
        };
        let set_file = |k: &'static str, v: &'static str| -> Change {
            Box::new(move |p: &mut FakeProbe| {
                p.files.insert(k.into(), v.into());
            })
        };
        let cases: Vec<(&str, Change)> = vec![
            (
                "cpu",
                set_file(
                    "/proc/cpuinfo",
                    "processor\t: 0\nmodel name\t: Intel Xeon\nprocessor\t: 1\nmodel name\t: Intel Xeon\n",
                ),
            ),
            (
                "cpu-cores",
                set_file(
                    "/proc/cpuinfo",
                    "processor\t: 0\nmodel name\t: AMD EPYC 9555\n",
                ),
            ),
            (
                "kernel",
                set_file("/proc/sys/kernel/osrelease", "6.12.50\n"),
            ),
            (
                "memlock",
                set_file(
                    "/proc/self/limits",
                    "Max locked memory         8388608              8388608              bytes\n",
                ),
            ),
            (
                "gpus",
                set_prog(
                    "nvidia-smi --query-gpu=name --format=csv,noheader",
                    "NVIDIA RTX PRO 6000 Blackwell Server Edition\nNVIDIA H100\n",
                ),
            ),
            (
                "driver",
                set_prog(
                    "nvidia-smi --query-gpu=driver_version --format=csv,noheader",
                    "580.105.08\n",
                ),
            ),
            (
                "cuda",
                set_prog(
                    "nvidia-smi",
                    "Driver Version: 580.95.05  CUDA Version: 13.1\n",
                ),
            ),
            (
                "gpu-topology",
                set_prog(
                    "nvidia-smi topo -m",
                    "\tGPU0\tGPU1\nGPU0\t X \tSYS\nGPU1\tSYS\t X \n",
                ),
            ),
            (
                "nccl",
                set_prog(
                    "ldconfig -p",
                    "\tlibnccl.so.2.28.3 (libc6,x86-64) => /usr/lib/libnccl.so.2.28.3\n",
                ),
            ),
        ];
        for (field, change) in cases {
            let mut p = base.clone();
            change(&mut p);
            let d = drift(&locked, &Fingerprint::collect(&p, "avx512-vnni"));
            let names: Vec<&str> = d.iter().map(|x| x.field.as_str()).collect();
            assert_eq!(names, [field], "changing {field}");
        }
        let d = drift(&locked, &Fingerprint::collect(&base, "avx2"));
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].field, "simd");
        // A commit that touches only documentation: another revision, the same build.
        let mut docs_only = locked.clone();
        docs_only.git_rev = "0123456789ab".into();
        assert_eq!(drift(&locked, &docs_only), []);
        let mut upgraded = docs_only;
        upgraded.kiln_version = "0.2.0".into();
        upgraded.source = "00ff00ff00ff00ff".into();
        upgraded.patches = vec!["nccl-fix.patch=abc".into()];
        upgraded.inputs = "nixpkgs=531670d;crane=2c71e19".into();
        let names: Vec<String> = drift(&locked, &upgraded)
            .into_iter()
            .map(|d| d.field)
            .collect();
        assert_eq!(names, ["kiln-version", "source", "patches", "inputs"]);
    }
}
