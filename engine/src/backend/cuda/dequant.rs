//! Weights to bf16 on the GPU at load (dequant.cu): a tensor's stored bytes are uploaded as
//! they are, a quarter to an eighth of the f32 values the host would otherwise make and send,
//! and one thread per stored block writes its bf16 values in place.

use cudarc::driver::{CudaViewMut, PushKernelArg};
use half::bf16;

use super::backend::{CudaBackend, cfg};
use crate::error::{Error, Result};
use crate::weights::{DType, TensorView};

/// dequant.cu's type code (the ggml type id) and how many values one stored block holds. Every
/// type kiln reads has a case there; a new one fails to compile here until it gets one.
pub fn kernel_code(dtype: DType) -> i32 {
    match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Q4_0 => 2,
        DType::Q4_1 => 3,
        DType::Q5_0 => 6,
        DType::Q5_1 => 7,
        DType::Q8_0 => 8,
        DType::Q4_K => 12,
        DType::Q5_K => 13,
        DType::Q6_K => 14,
        DType::BF16 => 30,
    }
}

impl CudaBackend {
    /// Writes `t`'s values as bf16 into `dst` (exactly `t.n_elements()` long).
    pub(super) fn dequantize_into(
        &self,
        t: &TensorView,
        dst: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        let n = t.n_elements();
        let bytes = t.bytes();
        if t.dtype.bytes_for(n) != Some(bytes.len()) || dst.len() != n {
            return Err(Error::tensor(
                &t.path,
                &t.name,
                format!(
                    "{} bytes of {:?} for {n} values (into {} on the device)",
                    bytes.len(),
                    t.dtype,
                    dst.len()
                ),
            ));
        }
        if n == 0 {
            return Ok(());
        }
        let src = self.upload(bytes)?;
        let code = kernel_code(t.dtype);
        let n_blocks = (n / t.dtype.block_len()) as i64;
        let mut b = self.stream().launch_builder(self.f("kiln_dequant_bf16")?);
        b.arg(&src).arg(&code).arg(&n_blocks).arg(dst);
        // SAFETY: dequant.cu reads n_blocks whole blocks of `code` from `src` (its length was
        // checked above) and writes block_len values per block into `dst` (n values).
        unsafe {
            self.launch(
                &mut b,
                cfg(((n_blocks as usize).div_ceil(256), 1, 1), 256, 0),
                "dequantize launch",
            )
        }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_s_kernel_code_is_its_ggml_id() {
        for id in 0..40 {
            if let Some(d) = DType::from_ggml(id) {
                assert_eq!(kernel_code(d), id as i32, "{d:?}");
            }
        }
    }
}
