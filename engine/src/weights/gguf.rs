//! GGUF v2/v3 reader: header, metadata key/values, tensor index, memory-mapped tensor data.
//! Layout per ggml's docs/gguf.md. Every read is bounds-checked: a truncated or corrupt file is an
//! `Error::Format` naming the file, never a panic.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use super::TensorView;
use super::dtype::DType;
use crate::error::{Error, Result};

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    Str(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v as u64),
            MetaValue::U16(v) => Some(v as u64),
            MetaValue::U32(v) => Some(v as u64),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) if v >= 0 => Some(v as u64),
            MetaValue::I16(v) if v >= 0 => Some(v as u64),
            MetaValue::I32(v) if v >= 0 => Some(v as u64),
            MetaValue::I64(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v as f64),
            MetaValue::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Where one tensor lives in the file.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the row length (contiguous), `dims[1]` the number of rows.
    pub dims: Vec<u64>,
    pub dtype: DType,
    /// Byte offset from the start of the file.
    pub offset: usize,
    pub n_bytes: usize,
    /// The ggml type id when kiln cannot read this tensor's type (an error only if the model uses it).
    pub unsupported_type: Option<u32>,
}

/// An opened GGUF file.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: HashMap<String, MetaValue>,
    pub tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
    mmap: Arc<Mmap>,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| {
                Error::format(
                    self.path,
                    format!(
                        "truncated GGUF file: reading {what} at byte {} needs {n} bytes",
                        self.pos
                    ),
                )
            })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16> {
        let b = self.take(2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn len(&mut self, what: &str) -> Result<usize> {
        let n = self.u64(what)?;
        // Any length larger than the file is corrupt; checking here keeps allocations bounded.
        if n > self.buf.len() as u64 {
            return Err(Error::format(
                self.path,
                format!("corrupt GGUF file: {what} claims length {n}, larger than the file"),
            ));
        }
        Ok(n as usize)
    }
    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.len(what)?;
        let b = self.take(n, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| {
            Error::format(self.path, format!("corrupt GGUF file: {what} is not UTF-8"))
        })
    }
    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<MetaValue> {
        Ok(match ty {
            0 => MetaValue::U8(self.u8(key)?),
            1 => MetaValue::I8(self.u8(key)? as i8),
            2 => MetaValue::U16(self.u16(key)?),
            3 => MetaValue::I16(self.u16(key)? as i16),
            4 => MetaValue::U32(self.u32(key)?),
            5 => MetaValue::I32(self.u32(key)? as i32),
            6 => MetaValue::F32(f32::from_bits(self.u32(key)?)),
            7 => MetaValue::Bool(self.u8(key)? != 0),
            8 => MetaValue::Str(self.string(key)?),
            9 if depth == 0 => {
                let elem_ty = self.u32(key)?;
                let n = self.len(key)?;
                let mut items = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    items.push(self.value(elem_ty, key, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(self.u64(key)?),
            11 => MetaValue::I64(self.u64(key)? as i64),
            12 => MetaValue::F64(f64::from_bits(self.u64(key)?)),
            _ => {
                return Err(Error::format(
                    self.path,
                    format!("corrupt GGUF file: metadata `{key}` has unknown value type {ty}"),
                ));
            }
        })
    }
}

impl GgufFile {
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the file is opened read-only; kiln never writes model files, and a model file changed
        // underneath a running server is outside what any engine can defend against.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        Self::parse(path, Arc::new(mmap))
    }

    fn parse(path: &Path, mmap: Arc<Mmap>) -> Result<GgufFile> {
        let mut c = Cursor {
            buf: &mmap[..],
            pos: 0,
            path,
        };
        let magic = c.take(4, "magic")?;
        if magic != b"GGUF" {
            return Err(Error::format(
                path,
                "not a GGUF file (magic bytes are not `GGUF`)",
            ));
        }
        let version = c.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(Error::format(
                path,
                format!("GGUF version {version} is not supported (2 or 3)"),
            ));
        }
        let n_tensors = c.len("tensor count")?;
        let n_kv = c.len("metadata count")?;
        let mut metadata = HashMap::new();
        for _ in 0..n_kv {
            let key = c.string("metadata key")?;
            let ty = c.u32(&key)?;
            let v = c.value(ty, &key, 0)?;
            metadata.insert(key, v);
        }
        let mut tensors = Vec::with_capacity(n_tensors.min(1 << 16));
        let mut raw_offsets = Vec::with_capacity(n_tensors.min(1 << 16));
        for _ in 0..n_tensors {
            let name = c.string("tensor name")?;
            let n_dims = c.u32(&name)? as usize;
            if n_dims > 4 {
                return Err(Error::tensor(
                    path,
                    &name,
                    format!("{n_dims} dimensions (at most 4)"),
                ));
            }
            let mut dims = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                dims.push(c.u64(&name)?);
            }
            let ty = c.u32(&name)?;
            let offset = c.u64(&name)?;
            let dtype = DType::from_ggml(ty).ok_or(ty);
            raw_offsets.push((name, dims, dtype, offset));
        }
        let alignment = metadata
            .get("general.alignment")
            .and_then(|v| v.as_u64())
            .unwrap_or(32)
            .max(1) as usize;
        let data_start = c.pos.div_ceil(alignment) * alignment;
        let file_len = mmap.len();
        for (name, dims, dtype, offset) in raw_offsets {
            // Unsupported types are only an error when the model actually uses that tensor.
            let n_elems = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
            let (dtype, n_bytes) = match (dtype, n_elems) {
                (Ok(dt), Some(n)) => {
                    let nb = dt.bytes_for(n as usize).ok_or_else(|| {
                        Error::tensor(
                            path,
                            &name,
                            format!("{n} elements is not a whole number of {dt:?} blocks"),
                        )
                    })?;
                    (dt, nb)
                }
                (Err(ty), _) => {
                    tensors.push(TensorInfo {
                        name: name.clone(),
                        dims,
                        dtype: DType::F32,
                        offset: 0,
                        n_bytes: 0,
                        unsupported_type: Some(ty),
                    });
                    continue;
                }
                (_, None) => return Err(Error::tensor(path, &name, "element count overflows")),
            };
            let start = data_start
                .checked_add(offset as usize)
                .filter(|s| s.checked_add(n_bytes).is_some_and(|e| e <= file_len))
                .ok_or_else(|| {
                    Error::tensor(
                        path,
                        &name,
                        format!(
                            "data at offset {offset} (+{n_bytes} bytes) lies beyond the end of the file ({file_len} bytes): truncated file"
                        ),
                    )
                })?;
            tensors.push(TensorInfo {
                name,
                dims,
                dtype,
                offset: start,
                n_bytes,
                unsupported_type: None,
            });
        }
        let by_name = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(GgufFile {
            path: path.to_path_buf(),
            version,
            metadata,
            tensors,
            by_name,
            mmap,
        })
    }

    pub fn meta(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    pub fn meta_str(&self, key: &str) -> Option<&str> {
        self.meta(key).and_then(|v| v.as_str())
    }

    pub fn meta_u64(&self, key: &str) -> Option<u64> {
        self.meta(key).and_then(|v| v.as_u64())
    }

    pub fn meta_f64(&self, key: &str) -> Option<f64> {
        self.meta(key).and_then(|v| v.as_f64())
    }

    pub fn meta_bool(&self, key: &str) -> Option<bool> {
        self.meta(key).and_then(|v| v.as_bool())
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    /// A tensor's bytes and logical shape `[rows, cols]` (row-major; `cols` is contiguous).
    pub fn view(&self, name: &str) -> Result<TensorView> {
        let info = self
            .by_name
            .get(name)
            .map(|&i| &self.tensors[i])
            .ok_or_else(|| Error::tensor(&self.path, name, "missing from the file"))?;
        if let Some(ty) = info.unsupported_type {
            return Err(Error::tensor(
                &self.path,
                name,
                format!(
                    "tensor type {} (ggml id {ty}) is not supported; kiln reads F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K",
                    DType::ggml_name(ty)
                ),
            ));
        }
        let mut shape: Vec<usize> = info.dims.iter().rev().map(|&d| d as usize).collect();
        if shape.is_empty() {
            shape.push(1);
        }
        Ok(TensorView {
            name: name.to_string(),
            path: self.path.clone(),
            dtype: info.dtype,
            shape,
            mmap: self.mmap.clone(),
            offset: info.offset,
            n_bytes: info.n_bytes,
            file_backed: true,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_gguf(tensor_bytes: usize, claimed_elems: u64) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes()); // tensors
        b.extend_from_slice(&1u64.to_le_bytes()); // kv
        let key = b"general.architecture";
        b.extend_from_slice(&(key.len() as u64).to_le_bytes());
        b.extend_from_slice(key);
        b.extend_from_slice(&8u32.to_le_bytes());
        b.extend_from_slice(&5u64.to_le_bytes());
        b.extend_from_slice(b"llama");
        let name = b"w";
        b.extend_from_slice(&(name.len() as u64).to_le_bytes());
        b.extend_from_slice(name);
        b.extend_from_slice(&1u32.to_le_bytes());
        b.extend_from_slice(&claimed_elems.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes()); // F32
        b.extend_from_slice(&0u64.to_le_bytes());
        while b.len() % 32 != 0 {
            b.push(0);
        }
        b.extend(std::iter::repeat_n(0u8, tensor_bytes));
        b
    }

    fn parse_bytes(bytes: Vec<u8>) -> Result<GgufFile> {
        let dir = std::env::temp_dir().join(format!(
            "kiln-gguf-test-{}-{}",
            std::process::id(),
            bytes.len()
        ));
        std::fs::write(&dir, &bytes).expect("write temp file");
        let r = GgufFile::open(&dir);
        let _ = std::fs::remove_file(&dir);
        r
    }

    #[test]
    fn reads_metadata_and_tensor() {
        let g = parse_bytes(write_gguf(16, 4)).expect("valid file");
        assert_eq!(g.meta_str("general.architecture"), Some("llama"));
        let v = g.view("w").expect("tensor");
        assert_eq!(v.shape, vec![4]);
        assert_eq!(v.bytes().len(), 16);
    }

    #[test]
    fn truncated_data_names_the_tensor() {
        let err = parse_bytes(write_gguf(8, 4)).err().expect("must fail");
        let msg = err.to_string();
        assert!(
            msg.contains("tensor `w`") && msg.contains("truncated"),
            "{msg}"
        );
    }

    #[test]
    fn truncated_header_is_an_error() {
        let mut b = write_gguf(16, 4);
        b.truncate(30);
        let msg = parse_bytes(b).err().expect("must fail").to_string();
        assert!(msg.contains("truncated"), "{msg}");
    }

    #[test]
    fn wrong_magic_is_an_error() {
        let mut b = write_gguf(16, 4);
        b[0] = b'X';
        let msg = parse_bytes(b).err().expect("must fail").to_string();
        assert!(msg.contains("not a GGUF file"), "{msg}");
    }
}
