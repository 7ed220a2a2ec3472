//! One GPU opened for kiln: its context and stream, every kernel compiled by NVRTC for its own
//! architecture, and cuBLASLt. Each missing piece (driver, device, NVRTC, cuBLASLt) is an error
//! naming it, checked before cudarc is asked to load it (its loaders panic on a missing library).

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublaslt::CudaBlasLT;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream};

use super::kernels::{self, SOURCES};

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub sm_count: usize,
    /// Bytes per second the memory's clock and bus width allow (double data rate), where the
    /// driver reports both: the roofline kiln's kernel timings are set beside.
    pub peak_read_bandwidth: Option<f64>,
    functions: HashMap<&'static str, CudaFunction>,
}

/// The NVRTC virtual architecture for a compute capability kiln compiles for.
pub fn virtual_arch(cc: (i32, i32)) -> Result<&'static str, String> {
    Ok(match cc {
        (8, 0) => "compute_80",
        (8, 6) => "compute_86",
        (8, 9) => "compute_89",
        (9, 0) => "compute_90",
        (10, 0) => "compute_100",
        (12, 0) => "compute_120",
        other => {
            return Err(format!(
                "compute capability {}.{} is not one kiln compiles for (8.0 to 12.0)",
                other.0, other.1
            ));
        }
    })
}

/// A CUDA error as a message naming what failed.
pub(super) fn err<E: std::fmt::Debug>(what: &str) -> impl FnOnce(E) -> String + '_ {
    move |e| format!("{what}: {e:?}")
}

impl Gpu {
    /// Opens device `ordinal` and compiles every kernel for it.
    pub fn open(ordinal: usize) -> Result<Gpu, String> {
        let report = super::probe()?;
        if report.devices.len() <= ordinal {
            return Err(format!(
                "no CUDA device {ordinal}: the driver sees {} device(s)",
                report.devices.len()
            ));
        }
        if !report.nvrtc {
            return Err(
                "NVRTC (libnvrtc.so.13) is not loadable: put the CUDA 13 lib folder on \
                 LD_LIBRARY_PATH"
                    .into(),
            );
        }
        let ctx = CudaContext::new(ordinal).map_err(err("opening the CUDA device"))?;
        let compute_capability = ctx
            .compute_capability()
            .map_err(err("reading the compute capability"))?;
        let target = kernels::Target {
            virtual_arch: virtual_arch(compute_capability)?,
            sm: "",
        };
        let mut functions = HashMap::new();
        for k in SOURCES {
            let ptx = kernels::compile_ptx(k, target, None)?;
            let module = ctx
                .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
                .map_err(err(k.file))?;
            for name in k.entry_points {
                functions.insert(*name, module.load_function(name).map_err(err(name))?);
            }
        }
        use cudarc::driver::sys::CUdevice_attribute as A;
        let sm_count = ctx
            .attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(err("reading the SM count"))? as usize;
        let name = ctx.name().map_err(err("reading the device name"))?;
        let peak_read_bandwidth = match (
            ctx.attribute(A::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE),
            ctx.attribute(A::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH),
        ) {
            (Ok(khz), Ok(bits)) if khz > 0 && bits > 0 => {
                Some(2.0 * khz as f64 * 1e3 * bits as f64 / 8.0)
            }
            _ => None,
        };
        // One created stream carries everything: a graph cannot be captured on the legacy
        // default stream. Event tracking is off before the first allocation: with one stream
        // the order is the stream's, and cudarc's cross-stream event waits would break a capture.
        // SAFETY: nothing is allocated on this context yet, and kiln uses this one stream only.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(err("creating a stream"))?;
        Ok(Gpu {
            stream,
            ctx,
            name,
            compute_capability,
            sm_count,
            peak_read_bandwidth,
            functions,
        })
    }

    /// cuBLASLt on this GPU's stream.
    pub fn blas(&self) -> Result<CudaBlasLT, String> {
        // SAFETY: dlopen probe only.
        if !unsafe { cudarc::cublaslt::sys::is_culib_present() } {
            return Err(
                "cuBLASLt (libcublasLt.so.13) is not loadable: put the CUDA 13 lib folder on \
                 LD_LIBRARY_PATH"
                    .into(),
            );
        }
        CudaBlasLT::new(self.stream.clone()).map_err(err("creating the cuBLASLt handle"))
    }

    pub fn f(&self, name: &str) -> Result<&CudaFunction, String> {
        self.functions
            .get(name)
            .ok_or_else(|| format!("kernel {name} not loaded"))
    }
}
