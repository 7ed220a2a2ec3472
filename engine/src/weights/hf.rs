//! Hugging Face model directories: `config.json`, `tokenizer.json`, and the weights as one
//! `model.safetensors` or shards listed in `model.safetensors.index.json`.
//!
//! Two quantized checkpoint layouts are repacked when a weight is read (`quantized`), kept packed
//! where that is lossless: DeepSeek-V3's block FP8 (as `F8Blocks`) and compressed-tensors'
//! packed INT4 (Kimi-K2-Thinking's experts, as `Q4_0`).

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
    I32,
    F8E4M3,
    Other(safetensors::Dtype),
}

/// An opened HF model directory: every tensor of every shard indexed by name.
pub struct HfDir {
    pub dir: PathBuf,
    files: Vec<(PathBuf, Arc<Mmap>)>,
    tensors: HashMap<String, Entry>,
    quant: super::quantized::Scheme,
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
                    safetensors::Dtype::I32 => Stored::I32,
                    safetensors::Dtype::F8_E4M3 => Stored::F8E4M3,
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
        let quant = super::quantized::Scheme::from_config(&dir.join("config.json"))?;
        Ok(HfDir {
            dir,
            files,
            tensors,
            quant,
        })
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.tensors.contains_key(name) || self.packed_base(name).is_some()
    }

    /// `X` for a weight `X.weight` stored packed as `X.weight_packed` (compressed-tensors).
    fn packed_base<'a>(&self, name: &'a str) -> Option<&'a str> {
        let base = name.strip_suffix(".weight")?;
        self.tensors
            .contains_key(&format!("{base}.weight_packed"))
            .then_some(base)
    }

    /// A stored tensor's raw bytes, its element type and shape.
    fn raw(&self, name: &str) -> Result<(&Path, &[u8], Stored, &[usize])> {
        let e = self
            .tensors
            .get(name)
            .ok_or_else(|| Error::tensor(&self.dir, name, "missing from the safetensors files"))?;
        let (path, mmap) = &self.files[e.file];
        Ok((
            path,
            &mmap[e.offset..e.offset + e.n_bytes],
            e.dtype,
            &e.shape,
        ))
    }

    /// A float tensor's values and shape (for scales).
    fn floats(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>)> {
        let v = self.view(name)?;
        Ok((v.to_f32(), v.shape))
    }

    /// A 32-bit integer tensor's values.
    fn int32s(&self, name: &str) -> Result<(Vec<i32>, Vec<usize>)> {
        let (path, bytes, dtype, shape) = self.raw(name)?;
        if !matches!(dtype, Stored::I32) {
            return Err(Error::tensor(path, name, "must be an int32 tensor"));
        }
        let v = bytes
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        Ok((v, shape.to_vec()))
    }

    pub fn view(&self, name: &str) -> Result<TensorView> {
        if !self.tensors.contains_key(name)
            && let Some(base) = self.packed_base(name)
        {
            return self.packed_int4(name, base);
        }
        let e = self
            .tensors
            .get(name)
            .ok_or_else(|| Error::tensor(&self.dir, name, "missing from the safetensors files"))?;
        let (path, mmap) = &self.files[e.file];
        let dtype = match e.dtype {
            Stored::Float(d) => d,
            Stored::F8E4M3 => return self.block_fp8(name),
            Stored::I64 | Stored::I32 => {
                return Err(Error::tensor(path, name, "is an integer tensor"));
            }
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
            file_backed: true,
        })
    }

    /// DeepSeek-V3's FP8 weight: e4m3 values times `{name}_scale_inv`, one f32 per block of
    /// `weight_block_size` (from config.json's `quantization_config`).
    fn block_fp8(&self, name: &str) -> Result<TensorView> {
        let (path, bytes, _, shape) = self.raw(name)?;
        let path = path.to_path_buf();
        let [rows, cols] = *shape else {
            return Err(Error::tensor(&path, name, "an FP8 weight must be a matrix"));
        };
        if rows == 0 || cols == 0 {
            return Err(Error::tensor(
                &path,
                name,
                format!("shape {shape:?} is empty"),
            ));
        }
        let block = self.quant.fp8_block.ok_or_else(|| {
            Error::tensor(
                &path,
                name,
                "is FP8 but config.json has no quantization_config.weight_block_size",
            )
        })?;
        let scale_name = format!("{name}_scale_inv");
        let (scales, scale_shape) = self.floats(&scale_name)?;
        let want = [rows.div_ceil(block[0]), cols.div_ceil(block[1])];
        if scale_shape != want {
            return Err(Error::tensor(
                &path,
                &scale_name,
                format!("shape {scale_shape:?}, blocks of {block:?} need {want:?}"),
            ));
        }
        if let Some(at) = super::quantized::first_e4m3_nan(bytes) {
            return Err(Error::tensor(
                &path,
                name,
                format!("holds an FP8 NaN at element {at}: the checkpoint is damaged"),
            ));
        }
        // Kept packed where the rows are whole scale blocks (DeepSeek-V3's and Kimi-K2's
        // weights): exact mode dequantizes it, fast mode reads it as it is.
        let view = match super::quantized::repack_block_fp8(bytes, rows, cols, block, &scales) {
            Some(packed) => TensorView::from_bytes(
                name.to_string(),
                path,
                DType::F8Blocks(block[1] as u16),
                vec![rows, cols],
                &packed,
            ),
            None => {
                let values =
                    super::quantized::dequantize_block_fp8(bytes, rows, cols, block, &scales);
                TensorView::from_f32(name.to_string(), path, vec![rows, cols], &values)
            }
        };
        self.release(name);
        view
    }

    /// Drops the file pages of a stored tensor whose bytes have been copied into another form.
    fn release(&self, name: &str) {
        if let Some(e) = self.tensors.get(name) {
            super::release_file_pages(&self.files[e.file].1, e.offset, e.n_bytes);
        }
    }

    /// compressed-tensors' pack-quantized INT4 weight: `X.weight_packed` (eight 4-bit values per
    /// int32, low bits first, offset by 8), `X.weight_scale` per group, `X.weight_shape`.
    fn packed_int4(&self, name: &str, base: &str) -> Result<TensorView> {
        let packed_name = format!("{base}.weight_packed");
        let (path, ..) = self.raw(&packed_name)?;
        let path = path.to_path_buf();
        let (packed, packed_shape) = self.int32s(&packed_name)?;
        let (shape, _) = self.int32s(&format!("{base}.weight_shape"))?;
        let (scales, scale_shape) = self.floats(&format!("{base}.weight_scale"))?;
        let bits = self.quant.int_bits.unwrap_or(4);
        if bits != 4 {
            return Err(Error::tensor(
                &path,
                &packed_name,
                format!("{bits}-bit packing is not supported (4-bit only)"),
            ));
        }
        let (rows, cols) = match shape.as_slice() {
            [r, c] if *r > 0 && *c > 0 => (*r as usize, *c as usize),
            s => {
                return Err(Error::tensor(
                    &path,
                    format!("{base}.weight_shape"),
                    format!("{s:?} is not a matrix shape"),
                ));
            }
        };
        let group = self.quant.group_size.unwrap_or(cols);
        let bad = |what: String| Error::tensor(&path, &packed_name, what);
        if packed_shape != [rows, cols.div_ceil(8)] {
            return Err(bad(format!(
                "shape {packed_shape:?}, a [{rows}, {cols}] weight packs into [{rows}, {}]",
                cols.div_ceil(8)
            )));
        }
        if group == 0 || scale_shape != [rows, cols.div_ceil(group)] {
            return Err(bad(format!(
                "scales of shape {scale_shape:?} do not fit groups of {group} in [{rows}, {cols}]"
            )));
        }
        // Kept packed where that is lossless (Kimi-K2-Thinking's groups of 32): fast mode reads
        // it with the Q4_0 kernels, exact mode dequantizes it as before.
        self.release(&packed_name);
        if let Some(q4_0) =
            super::quantized::repack_int4_as_q4_0(&packed, rows, cols, group, &scales)
        {
            return TensorView::from_bytes(
                name.to_string(),
                path,
                DType::Q4_0,
                vec![rows, cols],
                &q4_0,
            );
        }
        let values = super::quantized::dequantize_packed_int4(&packed, rows, cols, group, &scales);
        TensorView::from_f32(name.to_string(), path, vec![rows, cols], &values)
    }

    /// A 64-bit integer tensor's values (little-endian, as safetensors stores them).
    pub fn ints(&self, name: &str) -> Result<Vec<i64>> {
        let (path, bytes, dtype, _) = self.raw(name)?;
        if !matches!(dtype, Stored::I64) {
            return Err(Error::tensor(path, name, "must be an int64 tensor"));
        }
        Ok(bytes
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap_or_default()))
            .collect())
    }
}
