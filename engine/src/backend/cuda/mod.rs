//! The CUDA side: finding the driver and libraries at run time ([`probe`]) and kiln's own kernels
//! ([`kernels`]), compiled with NVRTC. Everything here loads its libraries dynamically, so a
//! `--features cuda` binary starts, and says what is missing, on a machine without a GPU.

pub mod kernels;
mod nccl_sweep;
pub mod parity;
mod probe;

pub use nccl_sweep::nccl_sweep;
pub use probe::{CudaReport, probe};
