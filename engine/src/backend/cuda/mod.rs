//! The CUDA side: finding the driver and libraries at run time ([`probe`]) and kiln's own kernels
//! ([`kernels`]), compiled with NVRTC. Everything here loads its libraries dynamically, so a
//! `--features cuda` binary starts, and says what is missing, on a machine without a GPU.

pub mod kernels;
pub mod parity;
mod probe;

pub use probe::{CudaReport, probe};
