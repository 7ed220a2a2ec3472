//! One error type for the engine library. Every variant names what the user has to fix: the file, the
//! tensor, the field.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The file exists but its bytes are not what the format says (truncated, corrupt, wrong magic).
    #[error("{}: {msg}", path.display())]
    Format { path: PathBuf, msg: String },
    /// One tensor in a weight file is missing, has the wrong shape, or a type we cannot compute with.
    #[error("{}: tensor `{tensor}`: {msg}", path.display())]
    Tensor {
        path: PathBuf,
        tensor: String,
        msg: String,
    },
    /// A model configuration value is missing or out of range (field named in the message).
    #[error("{}: {msg}", path.display())]
    Config { path: PathBuf, msg: String },
    #[error("unsupported architecture `{arch}` in {}: kiln runs llama, mistral, qwen2 and qwen3", path.display())]
    UnsupportedArchitecture { path: PathBuf, arch: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// A caller asked for something impossible (bad sampling parameter, prompt longer than the context, ...).
    #[error("{0}")]
    InvalidRequest(String),
    /// A tensor-parallel collective failed (a rank died or stalled): the group is down.
    #[error("tensor parallelism: {0}")]
    Parallel(#[from] crate::parallel::CommError),
    /// The chosen device cannot run here (not built in, or its driver or libraries are missing).
    #[error("{0}")]
    Device(String),
    /// The device failed a launch or a copy: CUDA errors are sticky, so nothing later can run.
    #[error("{0}")]
    DeviceLost(String),
    /// A compute job panicked (a bug): the step's requests fail, the server goes on.
    #[error("a compute job panicked: {0}")]
    Panicked(String),
    /// The paged KV cache has no free block left.
    #[error("KV cache is full: {needed} blocks needed, {free} free")]
    KvCacheFull { needed: usize, free: usize },
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// The backend's state is gone (a tensor-parallel rank died): no later step can succeed, so
    /// the process should exit for its service manager to restart it.
    pub fn backend_lost(&self) -> bool {
        matches!(self, Error::Parallel(_) | Error::DeviceLost(_))
    }
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
    pub fn format(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Format {
            path: path.into(),
            msg: msg.into(),
        }
    }
    pub fn tensor(
        path: impl Into<PathBuf>,
        tensor: impl Into<String>,
        msg: impl Into<String>,
    ) -> Self {
        Error::Tensor {
            path: path.into(),
            tensor: tensor.into(),
            msg: msg.into(),
        }
    }
    pub fn config(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Config {
            path: path.into(),
            msg: msg.into(),
        }
    }
}
