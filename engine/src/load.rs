//! Opening a model from a path: a `.gguf` file or a Hugging Face directory, with its tokenizer.

use std::path::Path;
use std::sync::Arc;

use crate::backend::{Backend, Precision};
use crate::error::{Error, Result};
use crate::model::{Llama, ModelConfig};
use crate::parallel::Shard;
use crate::tokenizer::Tokenizer;
use crate::weights::WeightStore;
use crate::weights::gguf::GgufFile;
use crate::weights::hf::HfDir;

/// Everything needed to run one model.
pub struct LoadedModel<B: Backend> {
    pub backend: B,
    pub model: Llama<B>,
    /// Shared with the layers above the runner (encoding, detokenizing, stop tokens).
    pub tokenizer: Arc<Tokenizer>,
    /// A short name for APIs and logs (the file or directory name).
    pub name: String,
}

impl<B: Backend> LoadedModel<B> {
    pub fn config(&self) -> &ModelConfig {
        &self.model.config
    }
}

/// Opens `path` and loads its weights through `backend`. `progress(done, total)` reports layers.
pub fn load_model<B: Backend>(
    backend: B,
    path: &Path,
    precision: Precision,
    progress: impl FnMut(usize, usize),
) -> Result<LoadedModel<B>> {
    load_model_shard(backend, path, precision, Shard::WHOLE, progress)
}

/// As [`load_model`], with only `shard`'s part of the weights (tensor parallelism's rank 0 in
/// the server; the tokenizer and config are whole).
pub fn load_model_shard<B: Backend>(
    backend: B,
    path: &Path,
    precision: Precision,
    shard: Shard,
    progress: impl FnMut(usize, usize),
) -> Result<LoadedModel<B>> {
    if !path.exists() {
        return Err(Error::io(
            path,
            std::io::Error::new(std::io::ErrorKind::NotFound, "model not found"),
        ));
    }
    // Weights first: a broken tensor is the more specific error than a tokenizer problem.
    let (store, config) = open_weights(path)?;
    let model = Llama::load_shard(&backend, config, &store, precision, shard, progress)?;
    let tokenizer = Arc::new(match &store {
        WeightStore::Hf(_) => Tokenizer::from_hf_dir(path)?,
        WeightStore::Gguf(g) => Tokenizer::from_gguf(g)?,
    });
    check_special_tokens(&tokenizer, model.config.vocab_size, path)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().trim_end_matches(".gguf").to_string())
        .unwrap_or_else(|| "model".to_string());
    Ok(LoadedModel {
        backend,
        model,
        tokenizer,
        name,
    })
}

/// BOS and every EOS id inside the model's vocabulary: an id past it would index the embedding
/// table out of bounds, or never match and never end a request.
fn check_special_tokens(t: &Tokenizer, vocab: usize, path: &Path) -> Result<()> {
    let named = t
        .bos_id
        .map(|id| ("bos_token_id", id))
        .into_iter()
        .chain(t.eos_ids.iter().map(|&id| ("eos_token_id", id)));
    for (field, id) in named {
        if id as usize >= vocab {
            return Err(Error::config(
                path,
                format!("{field} {id} is outside the vocabulary ({vocab} tokens)"),
            ));
        }
    }
    Ok(())
}

/// The weight store and model configuration of a `.gguf` file or a Hugging Face directory.
pub fn open_weights(path: &Path) -> Result<(WeightStore, ModelConfig)> {
    Ok(if path.is_dir() {
        let config = ModelConfig::from_hf_config(&path.join("config.json"))?;
        (WeightStore::Hf(HfDir::open(path)?), config)
    } else {
        let g = GgufFile::open(path)?;
        let config = ModelConfig::from_gguf(&g)?;
        (WeightStore::Gguf(g), config)
    })
}
