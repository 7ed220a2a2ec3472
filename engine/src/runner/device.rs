//! The one place a concrete backend is named: `--device cpu|cuda` becomes a backend here, and
//! everything above (the server, the CLI, the engine thread, the tensor-parallel peers) is handed
//! code to run over whichever backend that is, through [`WithBackend`], without naming its type.

use crate::backend::cpu::CpuBackend;
use crate::backend::cpu::simd::SimdLevel;
use crate::backend::{Backend, Precision};
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
    /// One NVIDIA GPU through CUDA (in the default build; not with `--no-default-features`).
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
        self.with_backend_on(0, threads, job)
    }

    /// As [`Device::with_backend`], on the device's `ordinal`th GPU (tensor-parallel rank r
    /// drives visible GPU r); the CPU has one device and ignores it.
    pub fn with_backend_on<J: WithBackend>(
        self,
        ordinal: usize,
        threads: Option<usize>,
        job: J,
    ) -> Result<J::Output> {
        match self {
            Device::Cpu => Ok(job.run(cpu(threads))),
            Device::Cuda => cuda(ordinal, job),
        }
    }

    /// Whether this device runs a model in `precision`; the error says
    /// what it does instead. On the GPU, `fast` means bf16 weights and activations with f32
    /// accumulation; `exact` (f32 throughout, the CPU's reference mode) is refused. Tensor
    /// parallelism over `world` GPUs puts rank r on visible GPU r and sums over NCCL.
    pub fn check(self, precision: Precision) -> Result<()> {
        match self {
            Device::Cpu => Ok(()),
            Device::Cuda if precision == Precision::Exact => Err(Error::Device(
                "--device cuda computes in bf16 (--mode fast); --mode exact (f32 throughout) \
                 runs on --device cpu"
                    .into(),
            )),
            Device::Cuda => Ok(()),
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

/// Visible GPU `ordinal` (`CUDA_VISIBLE_DEVICES` picks which GPUs an instance sees).
#[cfg(feature = "cuda")]
fn cuda<J: WithBackend>(ordinal: usize, job: J) -> Result<J::Output> {
    Ok(job.run(crate::backend::cuda::CudaBackend::open(ordinal)?))
}

#[cfg(not(feature = "cuda"))]
fn cuda<J: WithBackend>(_ordinal: usize, _job: J) -> Result<J::Output> {
    Err(Error::Device(
        "--device cuda: this kiln was built without CUDA support (build with `--features cuda`); \
         use --device cpu"
            .into(),
    ))
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

    /// On a machine without a GPU (CI, this test's home) `--device cuda` is an error naming
    /// what is missing (the build's CUDA support, or the driver), never the CPU backend.
    #[test]
    fn cpu_builds_the_cpu_backend_and_cuda_refuses_without_falling_back() {
        assert_eq!(Device::Cpu.with_backend(Some(1), Name).ok(), Some("cpu"));
        match Device::Cuda.with_backend(Some(1), Name) {
            Ok(name) => assert_eq!(name, "cuda", "a GPU machine must get the CUDA backend"),
            Err(e) => {
                let e = e.to_string();
                let named = if cfg!(feature = "cuda") {
                    e.contains("driver") || e.contains("NVRTC") || e.contains("cuBLASLt")
                } else {
                    e.contains("--features cuda")
                };
                assert!(e.contains("--device cuda") && named, "{e}");
            }
        }
    }

    #[test]
    fn the_gpu_refuses_exact_mode_by_name() {
        assert!(Device::Cpu.check(Precision::Exact).is_ok());
        assert!(Device::Cuda.check(Precision::Fast).is_ok());
        let exact = Device::Cuda
            .check(Precision::Exact)
            .err()
            .map(|e| e.to_string());
        assert!(exact.unwrap_or_default().contains("--mode exact"));
    }
}
