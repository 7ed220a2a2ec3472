//! Tokenizers: Hugging Face `tokenizer.json` through the `tokenizers` crate, a tiktoken
//! vocabulary (Kimi-K2's `tiktoken.model`), or a byte-level BPE tokenizer rebuilt from GGUF
//! metadata; the model's chat template; incremental detokenization.

pub mod chat_template;
pub mod detokenizer;
mod gguf_vocab;
pub mod tiktoken;
mod token_bytes;

use std::path::Path;

use crate::error::{Error, Result};
use crate::weights::gguf::GgufFile;

pub use chat_template::{ChatMessage, ChatTemplate};
pub use detokenizer::IncrementalDecoder;

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    pub bos_id: Option<u32>,
    /// Tokens that end generation (the EOS token, plus end-of-turn tokens the chat format uses).
    pub eos_ids: Vec<u32>,
    /// Whether encoding with special tokens prepends BOS (GGUF-built tokenizers only; a
    /// `tokenizer.json` does this in its post-processor).
    add_bos: bool,
    pub chat_template: Option<ChatTemplate>,
    /// The longest vocabulary entry in characters: no token covers more of a text.
    max_token_chars: usize,
}

/// Characters of the longest entry of `t`'s vocabulary (at least 1).
fn longest_token(t: &tokenizers::Tokenizer) -> usize {
    t.get_vocab(true)
        .keys()
        .map(|k| k.chars().count())
        .max()
        .unwrap_or(1)
        .max(1)
}

impl Tokenizer {
    pub fn from_gguf(g: &GgufFile) -> Result<Tokenizer> {
        Self::from_gguf_with_pre(g, None)
    }

    /// As [`Tokenizer::from_gguf`], with the named pre-tokenizer instead of the file's (tests
    /// check a pre-tokenizer on another model's vocabulary).
    pub fn from_gguf_with_pre(g: &GgufFile, pre: Option<&str>) -> Result<Tokenizer> {
        let built = gguf_vocab::build(g, pre)?;
        let template = match g.meta_str("tokenizer.chat_template") {
            Some(src) => Some(ChatTemplate::new(
                src,
                built.bos_text.clone(),
                built.eos_text.clone(),
            )?),
            None => None,
        };
        Ok(Tokenizer {
            max_token_chars: longest_token(&built.tokenizer),
            inner: built.tokenizer,
            bos_id: built.bos_id,
            eos_ids: built.eos_ids,
            add_bos: built.add_bos,
            chat_template: template,
        })
    }

    /// `tokenizer.json` (or Kimi-K2's `tiktoken.model`), with `tokenizer_config.json` (chat
    /// template, special tokens) and `generation_config.json` (EOS ids) when present.
    pub fn from_hf_dir(dir: &Path) -> Result<Tokenizer> {
        let config_path = dir.join("tokenizer_config.json");
        let config: serde_json::Value = read_json_if_exists(&config_path)?;
        let path = dir.join("tokenizer.json");
        let tiktoken_path = dir.join("tiktoken.model");
        let inner = if !path.exists() && tiktoken_path.exists() {
            Self::tiktoken_inner(dir, &tiktoken_path, &config, &config_path)?
        } else {
            tokenizers::Tokenizer::from_file(&path)
                .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?
        };
        let gen_config: serde_json::Value =
            read_json_if_exists(&dir.join("generation_config.json"))?;
        let token_text = |key: &str| -> Option<String> {
            match config.get(key) {
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                Some(serde_json::Value::Object(o)) => {
                    o.get("content").and_then(|c| c.as_str()).map(String::from)
                }
                _ => None,
            }
        };
        let bos_text = token_text("bos_token");
        let eos_text = token_text("eos_token");
        let bos_id = bos_text.as_deref().and_then(|t| inner.token_to_id(t));
        let mut eos_ids: Vec<u32> = eos_text
            .as_deref()
            .and_then(|t| inner.token_to_id(t))
            .into_iter()
            .collect();
        match gen_config.get("eos_token_id") {
            Some(serde_json::Value::Number(n)) => eos_ids.extend(n.as_u64().map(|v| v as u32)),
            Some(serde_json::Value::Array(a)) => {
                eos_ids.extend(a.iter().filter_map(|v| v.as_u64()).map(|v| v as u32))
            }
            _ => {}
        }
        eos_ids.sort_unstable();
        eos_ids.dedup();
        // Newer directories keep the template in a file of its own.
        let template_file = dir.join("chat_template.jinja");
        let template_src = match config.get("chat_template").and_then(|t| t.as_str()) {
            Some(src) => Some(src.to_string()),
            None if template_file.exists() => Some(
                std::fs::read_to_string(&template_file)
                    .map_err(|e| Error::io(&template_file, e))?,
            ),
            None => None,
        };
        let template = match template_src {
            Some(src) => Some(ChatTemplate::new(&src, bos_text, eos_text)?),
            None => None,
        };
        Ok(Tokenizer {
            max_token_chars: longest_token(&inner),
            inner,
            bos_id,
            eos_ids,
            add_bos: false,
            chat_template: template,
        })
    }

    /// A tiktoken vocabulary with its special tokens. Its split pattern lives in Python
    /// (`tokenization_kimi.py`), so only the one kiln knows is taken: Kimi-K2's, named by the
    /// tokenizer's `auto_map` or the model's `model_type`.
    fn tiktoken_inner(
        dir: &Path,
        path: &Path,
        config: &serde_json::Value,
        config_path: &Path,
    ) -> Result<tokenizers::Tokenizer> {
        let auto_map = config
            .get("auto_map")
            .map(|m| m.to_string())
            .unwrap_or_default();
        let model: serde_json::Value = read_json_if_exists(&dir.join("config.json"))?;
        let kimi = auto_map.contains("tokenization_kimi")
            || model.get("model_type").and_then(|t| t.as_str()) == Some("kimi_k2");
        if !kimi {
            return Err(Error::format(
                path,
                "a tiktoken vocabulary without tokenizer.json: its split pattern is known only \
                 for Kimi-K2 (tokenizer_config.json's auto_map naming tokenization_kimi, or \
                 config.json's model_type kimi_k2)",
            ));
        }
        let ranks = tiktoken::read_ranks(path)?;
        let added = tiktoken::added_tokens(config, ranks.len(), config_path)?;
        tiktoken::build(&ranks, tiktoken::KIMI_PATTERN, &added)
    }

    /// A lower bound on `text`'s token count, without tokenizing: no token covers more than the
    /// longest vocabulary entry (halved again for normalizers that merge characters), so a text
    /// far past the context is refused before the tokenizer expands it.
    pub fn min_tokens(&self, text: &str) -> usize {
        text.chars().count() / (2 * self.max_token_chars)
    }

    /// Token ids of `text`. Special tokens written in the text (`<|im_start|>`) become their ids;
    /// `add_special` adds what the model expects around a prompt (BOS for Llama 3, say).
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special)
            .map_err(|e| Error::Tokenizer(format!("encoding failed: {e}")))?;
        let mut ids = enc.get_ids().to_vec();
        if add_special
            && self.add_bos
            && let Some(b) = self.bos_id
            && ids.first() != Some(&b)
        {
            ids.insert(0, b);
        }
        Ok(ids)
    }

    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| Error::Tokenizer(format!("decoding failed: {e}")))
    }

    /// The tokenizer as a Hugging Face `tokenizer.json` document.
    pub fn to_json(&self) -> Result<String> {
        self.inner
            .to_string(true)
            .map_err(|e| Error::Tokenizer(format!("serializing: {e}")))
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_text(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_ids.contains(&id)
    }
}

fn read_json_if_exists(path: &Path) -> Result<serde_json::Value> {
    if !path.exists() {
        return Ok(serde_json::Value::Null);
    }
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::format(path, format!("invalid JSON: {e}")))
}
