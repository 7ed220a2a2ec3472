//! Hugging Face model directories: `config.json`, `tokenizer.json`, and the weights as one
//! `model.safetensors` or shards listed in `model.safetensors.index.json`.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use safetensors::SafeTensors;

use super::{DType, TensorView};
use crate::error::{Error, Result};

struct Entry {
    file: usize,
    dtype: Stored,
    shape: Vec<usize>,
    offset: usize,
    n_bytes: usize,
}

/// A tensor's element type as stored: a float kiln computes with, 64-bit integers (index
/// tensors such as an EAGLE-3 draft's `d2t`), or something only named in errors.
#[derive(Clone, Copy)]
enum Stored {
    Float(DType),
    I64,
    Other(safetensors::Dtype),
}

/// An opened HF model directory: every tensor of every shard indexed by name.
pub struct HfDir {
    pub dir: PathBuf,
    files: Vec<(PathBuf, Arc<Mmap>)>,
    tensors: HashMap<String, Entry>,
}

#[derive(serde::Deserialize)]
struct ShardIndex {
    weight_map: HashMap<String, String>,
}

impl HfDir {
    pub fn open(dir: impl AsRef<Path>) -> Result<HfDir> {
        let dir = dir.as_ref().to_path_buf();
        let index_path = dir.join("model.safetensors.index.json");
        let shard_names: Vec<String> = if index_path.exists() {
            let text =
                std::fs::read_to_string(&index_path).map_err(|e| Error::io(&index_path, e))?;
            let index: ShardIndex = serde_json::from_str(&text)
                .map_err(|e| Error::format(&index_path, format!("invalid shard index: {e}")))?;
            let mut names: Vec<String> = index.weight_map.into_values().collect();
            names.sort();
            names.dedup();
            names
        } else {
            vec!["model.safetensors".to_string()]
        };
        let mut files = Vec::new();
        let mut tensors = HashMap::new();
        for shard in shard_names {
            if shard.contains('/') || shard.contains("..") {
                return Err(Error::format(
                    &index_path,
                    format!("shard name `{shard}` leaves the directory"),
                ));
            }
            let path = dir.join(&shard);
            let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
            // SAFETY: read-only map of a file kiln never writes.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
            let st = SafeTensors::deserialize(&mmap[..])
                .map_err(|e| Error::format(&path, format!("invalid safetensors file: {e}")))?;
            let base = mmap.as_ptr() as usize;
            for (name, view) in st.tensors() {
                // Unsupported types fail when the tensor is used, not here: a checkpoint may carry
                // tensors kiln never reads (an EAGLE-3 draft's boolean `t2d`).
                let dtype = match view.dtype() {
                    safetensors::Dtype::F32 => Stored::Float(DType::F32),
                    safetensors::Dtype::F16 => Stored::Float(DType::F16),
                    safetensors::Dtype::BF16 => Stored::Float(DType::BF16),
                    safetensors::Dtype::I64 => Stored::I64,
                    other => Stored::Other(other),
                };
                let data = view.data();
                tensors.insert(
                    name,
                    Entry {
                        file: files.len(),
                        dtype,
                        shape: view.shape().to_vec(),
                        offset: data.as_ptr() as usize - base,
                        n_bytes: data.len(),
                    },
                );
            }
            files.push((path, Arc::new(mmap)));
        }
        Ok(HfDir {
            dir,
            files,
            tensors,
        })
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn view(&self, name: &str) -> Result<TensorView> {
        let e = self
            .tensors
            .get(name)
            .ok_or_else(|| Error::tensor(&self.dir, name, "missing from the safetensors files"))?;
        let (path, mmap) = &self.files[e.file];
        let dtype = match e.dtype {
            Stored::Float(d) => d,
            Stored::I64 => return Err(Error::tensor(path, name, "is an integer tensor")),
            Stored::Other(d) => {
                return Err(Error::tensor(
                    path,
                    name,
                    format!("dtype {d:?} is not supported"),
                ));
            }
        };
        Ok(TensorView {
            name: name.to_string(),
            path: path.clone(),
            dtype,
            shape: e.shape.clone(),
            mmap: mmap.clone(),
            offset: e.offset,
            n_bytes: e.n_bytes,
        })
    }

    /// A 64-bit integer tensor's values (little-endian, as safetensors stores them).
    pub fn ints(&self, name: &str) -> Result<Vec<i64>> {
        let e = self
            .tensors
            .get(name)
            .ok_or_else(|| Error::tensor(&self.dir, name, "missing from the safetensors files"))?;
        let (path, mmap) = &self.files[e.file];
        if !matches!(e.dtype, Stored::I64) {
            return Err(Error::tensor(path, name, "must be an int64 tensor"));
        }
        Ok(mmap[e.offset..e.offset + e.n_bytes]
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap_or_default()))
            .collect())
    }
}
