//! The CUDA side as far as it is built today: find the driver and libraries at run time (cudarc
//! loads them dynamically, so a `--features cuda` binary starts on a machine without a GPU) and
//! report what is there. cudarc's loaders panic when a library is missing, so each library is
//! looked up with `is_culib_present` before anything calls into it.

use cudarc::driver::result as cu;

/// What the CUDA stack on this machine offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaReport {
    /// `cuDriverGetVersion`, e.g. 13000 for CUDA 13.0.
    pub driver_version: i32,
    /// (name, compute capability major.minor, memory in bytes) per visible device.
    pub devices: Vec<(String, (i32, i32), usize)>,
    pub nvrtc: bool,
    pub cublas: bool,
    /// cuBLASLt, which the backend's GEMMs go through.
    pub cublaslt: bool,
    /// `ncclGetVersion`, e.g. 23007 for 2.30.7; None when libnccl is not loadable.
    pub nccl_version: Option<i32>,
}

/// Probes the driver and libraries; Err says what is missing, in words for `kiln doctor`.
pub fn probe() -> Result<CudaReport, String> {
    // SAFETY: is_culib_present only tries dlopen on the candidate names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("no CUDA driver: libcuda.so.1 is not loadable (install the NVIDIA driver; on NixOS it lives in /run/opengl-driver/lib)".into());
    }
    cu::init().map_err(|e| format!("cuInit failed: {e:?}"))?;
    let mut driver_version = 0;
    // SAFETY: the driver is loaded and initialised; the pointer is valid for one int.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver_version) }
        .result()
        .map_err(|e| format!("cuDriverGetVersion failed: {e:?}"))?;
    let count = cu::device::get_count().map_err(|e| format!("cuDeviceGetCount failed: {e:?}"))?;
    let mut devices = Vec::new();
    for ordinal in 0..count {
        let dev = cu::device::get(ordinal).map_err(|e| format!("device {ordinal}: {e:?}"))?;
        let name = cu::device::get_name(dev).map_err(|e| format!("device {ordinal}: {e:?}"))?;
        use cudarc::driver::sys::CUdevice_attribute as A;
        // SAFETY: `dev` came from cuDeviceGet above.
        let (major, minor, mem) = unsafe {
            (
                cu::device::get_attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                cu::device::get_attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
                cu::device::total_mem(dev),
            )
        };
        let err = |e| format!("device {ordinal}: {e:?}");
        devices.push((
            name,
            (major.map_err(err)?, minor.map_err(err)?),
            mem.map_err(err)?,
        ));
    }
    // SAFETY: as above, dlopen probes only.
    let nvrtc = unsafe { cudarc::nvrtc::sys::is_culib_present() };
    let cublas = unsafe { cudarc::cublas::sys::is_culib_present() };
    let cublaslt = unsafe { cudarc::cublaslt::sys::is_culib_present() };
    let nccl_version = if unsafe { cudarc::nccl::sys::is_culib_present() } {
        cudarc::nccl::result::get_nccl_version().ok()
    } else {
        None
    };
    Ok(CudaReport {
        driver_version,
        devices,
        nvrtc,
        cublas,
        cublaslt,
        nccl_version,
    })
}

impl CudaReport {
    /// One line for `kiln doctor`.
    pub fn summary(&self) -> String {
        let v = self.driver_version;
        let devices = match self.devices.first() {
            Some((name, (maj, min), mem)) => format!(
                "{} x {name} (sm_{maj}{min}, {} GiB)",
                self.devices.len(),
                mem >> 30
            ),
            None => "no device".into(),
        };
        let nccl = match self.nccl_version {
            Some(n) => format!("NCCL {}.{}.{}", n / 10000, (n / 100) % 100, n % 100),
            None => "no NCCL".into(),
        };
        format!(
            "CUDA driver API {}.{}; {devices}; NVRTC {}; cuBLAS {}; cuBLASLt {}; {nccl} (the \
             libraries load; `kiln gpu-check` validates the GPU path)",
            v / 1000,
            (v % 1000) / 10,
            if self.nvrtc { "ok" } else { "missing" },
            if self.cublas { "ok" } else { "missing" },
            if self.cublaslt { "ok" } else { "missing" },
        )
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn probe_reports_instead_of_panicking() {
        // On a machine without the driver this is the "no CUDA driver" error; with one, a report.
        match super::probe() {
            Ok(r) => assert!(r.driver_version >= 12000, "{r:?}"),
            Err(e) => assert!(!e.is_empty()),
        }
    }
}
