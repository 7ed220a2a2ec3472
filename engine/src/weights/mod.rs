//! Weight formats: GGUF files and Hugging Face model directories (safetensors), both memory-mapped and
//! exposed through one name-based view so the model loader does not care where a tensor came from.

pub mod dtype;
pub mod gguf;
pub mod hf;

use std::path::PathBuf;
use std::sync::Arc;

use memmap2::Mmap;

use crate::error::{Error, Result};
pub use dtype::DType;

/// A tensor's bytes inside a memory-mapped file.
#[derive(Clone)]
pub struct TensorView {
    pub name: String,
    pub path: PathBuf,
    pub dtype: DType,
    /// Logical row-major shape; the last dimension is contiguous.
    pub shape: Vec<usize>,
    mmap: Arc<Mmap>,
    offset: usize,
    n_bytes: usize,
}

impl TensorView {
    pub fn bytes(&self) -> &[u8] {
        &self.mmap[self.offset..self.offset + self.n_bytes]
    }

    pub fn n_elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// `[rows, cols]` for a matrix (a vector is one row).
    pub fn matrix_shape(&self) -> Result<(usize, usize)> {
        match self.shape.as_slice() {
            [c] => Ok((1, *c)),
            [r, c] => Ok((*r, *c)),
            s => Err(Error::tensor(
                &self.path,
                &self.name,
                format!("expected a matrix, found shape {s:?}"),
            )),
        }
    }

    /// Checks the shape, naming the file and tensor when it differs.
    pub fn expect_shape(&self, want: &[usize]) -> Result<()> {
        if self.shape != want {
            return Err(Error::tensor(
                &self.path,
                &self.name,
                format!("shape {:?}, the model config needs {:?}", self.shape, want),
            ));
        }
        Ok(())
    }

    /// All values as f32 (dequantized).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.n_elements()];
        dtype::dequantize(self.dtype, self.bytes(), &mut out);
        out
    }
}

/// Where a model's tensors come from.
pub enum WeightStore {
    Gguf(gguf::GgufFile),
    Hf(hf::HfDir),
}

impl WeightStore {
    pub fn get(&self, name: &str) -> Result<TensorView> {
        match self {
            WeightStore::Gguf(g) => g.view(name),
            WeightStore::Hf(h) => h.view(name),
        }
    }

    pub fn has(&self, name: &str) -> bool {
        match self {
            WeightStore::Gguf(g) => g.has_tensor(name),
            WeightStore::Hf(h) => h.has_tensor(name),
        }
    }
}
