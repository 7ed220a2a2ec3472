//! The one place a concrete backend is named: `--device cpu|cuda` becomes a backend here, and
//! everything above (the server, the CLI, the engine thread, the tensor-parallel peers) is handed
//! code to run over whichever backend that is, through [`WithBackend`], without naming its type.

use crate::backend::Backend;
use crate::backend::cpu::CpuBackend;
use crate::backend::cpu::simd::SimdLevel;
use crate::error::{Error, Result};

/// Where the model runs.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Default,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    /// The CPU backend (AVX2 / AVX-512 kernels, chosen at run time).
    #[default]
    Cpu,
    /// One NVIDIA GPU through CUDA (a `--features cuda` build).
    Cuda,
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
        })
    }
}

/// Code that runs over any backend: the caller's generic part, handed the backend `--device`
/// chose.
pub trait WithBackend {
    type Output;
    fn run<B: Backend + 'static>(self, backend: B) -> Self::Output;
}

impl Device {
    /// Builds this device's backend (`threads`: CPU compute threads, all cores by default) and
    /// runs `job` over it. A device this build or machine cannot drive is an error naming what is
    /// missing; nothing falls back to the CPU.
    pub fn with_backend<J: WithBackend>(self, threads: Option<usize>, job: J) -> Result<J::Output> {
        match self {
            Device::Cpu => Ok(job.run(cpu(threads))),
            Device::Cuda => Err(cuda_unavailable()),
        }
    }
}

/// The SIMD level the CPU backend's kernels run at on this machine, as the lock's fingerprint
/// names it.
pub fn cpu_simd_name() -> &'static str {
    match SimdLevel::detect() {
        SimdLevel::Scalar => "scalar",
        SimdLevel::Avx2 => "avx2",
        SimdLevel::Avx512Vnni => "avx512-vnni",
    }
}

fn cpu(threads: Option<usize>) -> CpuBackend {
    match threads {
        Some(t) => CpuBackend::with_threads(t.max(1)),
        None => CpuBackend::new(),
    }
}

fn cuda_unavailable() -> Error {
    Error::Device(if cfg!(feature = "cuda") {
        "--device cuda: the CUDA backend is not built yet (this build has the CUDA kernels and \
         probes, not a runner over them); use --device cpu"
            .into()
    } else {
        "--device cuda: this kiln was built without CUDA support (build with `--features cuda`); \
         use --device cpu"
            .into()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Name;
    impl WithBackend for Name {
        type Output = &'static str;
        fn run<B: Backend + 'static>(self, backend: B) -> &'static str {
            backend.name()
        }
    }

    #[test]
    fn cpu_builds_the_cpu_backend_and_cuda_refuses_without_falling_back() {
        assert_eq!(Device::Cpu.with_backend(Some(1), Name).ok(), Some("cpu"));
        let e = Device::Cuda
            .with_backend(Some(1), Name)
            .err()
            .map(|e| e.to_string());
        let e = e.unwrap_or_default();
        assert!(
            e.contains("--device cuda") && e.contains("--device cpu"),
            "{e}"
        );
    }
}
