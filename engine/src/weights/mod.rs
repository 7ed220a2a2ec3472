//! Weight formats: GGUF files and Hugging Face model directories (safetensors), both memory-mapped and
//! exposed through one name-based view so the model loader does not care where a tensor came from.

pub mod dtype;
pub mod gguf;
pub mod hf;
pub mod quantized;
mod transpose;

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
    /// A view of the model file (not a copy in anonymous memory): its pages can be released.
    file_backed: bool,
}

impl TensorView {
    pub fn bytes(&self) -> &[u8] {
        &self.mmap[self.offset..self.offset + self.n_bytes]
    }

    /// Tells the kernel this view's file pages may leave memory: a backend calls it once it has
    /// copied the weight into its own form, so resident memory at load holds each weight once
    /// (its prepared copy) rather than twice (that and the page cache's mapped file pages). A
    /// later read maps the pages in again from the file. Copies in anonymous memory are left
    /// alone: dropping those pages would zero them.
    pub fn release_pages(&self) {
        if self.file_backed && self.n_bytes > 0 {
            release_file_pages(&self.mmap, self.offset, self.n_bytes);
        }
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

    /// Matrix `i` of a stacked `[n, rows, cols]` tensor (GGUF stores a MoE layer's experts as
    /// one such tensor per projection), as a view of the same bytes: no copy.
    pub fn slab(&self, i: usize) -> Result<TensorView> {
        let [n, rows, cols] = *self.shape.as_slice() else {
            return Err(Error::tensor(
                &self.path,
                &self.name,
                format!("expected [n, rows, cols], found shape {:?}", self.shape),
            ));
        };
        let slab_bytes = self
            .dtype
            .bytes_for(rows * cols)
            .ok_or_else(|| Error::tensor(&self.path, &self.name, "a matrix is not whole blocks"))?;
        if i >= n {
            return Err(Error::tensor(
                &self.path,
                &self.name,
                format!("matrix {i} of {n}"),
            ));
        }
        Ok(TensorView {
            name: format!("{}[{i}]", self.name),
            path: self.path.clone(),
            dtype: self.dtype,
            shape: vec![rows, cols],
            mmap: self.mmap.clone(),
            offset: self.offset + i * slab_bytes,
            n_bytes: slab_bytes,
            file_backed: self.file_backed,
        })
    }

    /// The sub-matrix `rows x cols` of a `[rows, cols]` tensor, for sharding one layer across
    /// tensor-parallel ranks. Stored blocks are copied as they are when the column range falls on
    /// block boundaries (always true for whole rows); otherwise the slice is dequantized to f32.
    /// The copy lives in an anonymous mapping, so the result is a view like any other.
    pub fn slice(
        &self,
        rows: std::ops::Range<usize>,
        cols: std::ops::Range<usize>,
    ) -> Result<TensorView> {
        let (n_rows, n_cols) = self.matrix_shape()?;
        if rows.end > n_rows || cols.end > n_cols || rows.is_empty() || cols.is_empty() {
            return Err(Error::tensor(
                &self.path,
                &self.name,
                format!("slice rows {rows:?} cols {cols:?} outside shape [{n_rows}, {n_cols}]"),
            ));
        }
        let bad_row = || Error::tensor(&self.path, &self.name, "rows are not whole blocks");
        let row_bytes = self.dtype.bytes_for(n_cols).ok_or_else(bad_row)?;
        let block = self.dtype.block_len();
        let aligned = cols.start.is_multiple_of(block) && cols.len().is_multiple_of(block);
        let (dtype, bytes) = if aligned {
            let start = self.dtype.bytes_for(cols.start).ok_or_else(bad_row)?;
            let len = self.dtype.bytes_for(cols.len()).ok_or_else(bad_row)?;
            let src = self.bytes();
            let mut out = Vec::with_capacity(rows.len() * len);
            for r in rows.clone() {
                out.extend_from_slice(&src[r * row_bytes + start..r * row_bytes + start + len]);
            }
            (self.dtype, out)
        } else {
            let src = self.bytes();
            let mut row = vec![0f32; n_cols];
            let mut out = Vec::with_capacity(rows.len() * cols.len() * 4);
            for r in rows.clone() {
                dtype::dequantize(
                    self.dtype,
                    &src[r * row_bytes..(r + 1) * row_bytes],
                    &mut row,
                );
                for v in &row[cols.clone()] {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
            (DType::F32, out)
        };
        let mut map =
            memmap2::MmapMut::map_anon(bytes.len()).map_err(|e| Error::io(&self.path, e))?;
        map.copy_from_slice(&bytes);
        let mmap = map.make_read_only().map_err(|e| Error::io(&self.path, e))?;
        Ok(TensorView {
            name: format!("{}[{rows:?}, {cols:?}]", self.name),
            path: self.path.clone(),
            dtype,
            shape: if self.shape.len() == 1 {
                vec![cols.len()]
            } else {
                vec![rows.len(), cols.len()]
            },
            n_bytes: bytes.len(),
            mmap: Arc::new(mmap),
            offset: 0,
            file_backed: false,
        })
    }

    /// An f32 tensor built in memory (a transposed or dequantized copy of stored weights); `path`
    /// and `name` say where it came from in errors.
    pub fn from_f32(
        name: String,
        path: PathBuf,
        shape: Vec<usize>,
        values: &[f32],
    ) -> Result<TensorView> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Self::from_bytes(name, path, DType::F32, shape, &bytes)
    }

    /// A tensor of `dtype` built in memory from its stored bytes, which must be exactly the
    /// whole blocks `shape` needs.
    pub fn from_bytes(
        name: String,
        path: PathBuf,
        dtype: DType,
        shape: Vec<usize>,
        bytes: &[u8],
    ) -> Result<TensorView> {
        let n: usize = shape.iter().product();
        if dtype.bytes_for(n) != Some(bytes.len()) {
            return Err(Error::tensor(
                &path,
                &name,
                format!("{} bytes of {dtype:?} for shape {shape:?}", bytes.len()),
            ));
        }
        let mut map =
            memmap2::MmapMut::map_anon(bytes.len().max(1)).map_err(|e| Error::io(&path, e))?;
        map[..bytes.len()].copy_from_slice(bytes);
        let mmap = map.make_read_only().map_err(|e| Error::io(&path, e))?;
        Ok(TensorView {
            name,
            path,
            dtype,
            shape,
            mmap: Arc::new(mmap),
            offset: 0,
            n_bytes: bytes.len(),
            file_backed: false,
        })
    }

    /// All values as f32 (dequantized).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.n_elements()];
        dtype::dequantize(self.dtype, self.bytes(), &mut out);
        out
    }
}

/// `MADV_DONTNEED` over the whole pages of `len` bytes at `offset` in a read-only file mapping.
/// A hint: failure costs memory, never correctness, so it is ignored.
pub(crate) fn release_file_pages(mmap: &Mmap, offset: usize, len: usize) {
    #[cfg(unix)]
    // SAFETY: the mapping is read-only (shared) and of a file kiln never writes: dropping its
    // pages changes no byte any reference sees, a later read faults the same bytes back in.
    let _ = unsafe { mmap.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, offset, len) };
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
