//! The CUDA side: finding the driver and libraries at run time ([`probe`]), kiln's own kernels
//! ([`kernels`]) compiled with NVRTC for the GPU at hand ([`gpu`]), and the backend that runs the
//! model's ops on one GPU ([`CudaBackend`]). Everything here loads its libraries dynamically, so a
//! `--features cuda` binary starts, and says what is missing, on a machine without a GPU.

mod backend;
mod dequant;
mod experts;
pub mod gpu;
mod graphs;
pub mod kernels;
mod latent;
mod nccl_comm;
mod nccl_sweep;
mod oneshot;
pub mod op_parity;
mod packed_kernel;
pub mod parity;
mod probe;
mod sample;
mod staging;

pub use backend::{
    CudaBackend, CudaBuffer, CudaKvStore, CudaMatrix, CudaStepMeta, HostStepMeta,
    attention_shared_bytes, attention_splits, check_attention_shape, host_step_meta,
};
pub use experts::{CudaExperts, check_route, kimi_moe_layer_speed, max_tiles};
pub use latent::{CudaHeadMatrices, mla_chunk, mla_shared_bytes};
pub use nccl_comm::{NcclComm, ReplayWatch};
pub use nccl_sweep::nccl_sweep;
pub use oneshot::{OneShotGpu, one_shot_selftest, one_shot_sweep};
pub use packed_kernel::PackedKernel;
pub use probe::{CudaReport, probe};
