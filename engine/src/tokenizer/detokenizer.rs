//! Incremental detokenization: turns a growing list of token ids into text pieces, holding back bytes
//! until they form whole UTF-8 characters (an emoji can span several byte-level tokens).

use super::Tokenizer;
use crate::error::Result;

/// Decodes a window of recent tokens and emits only the new, complete suffix — the approach of TGI and
/// vLLM, which also keeps spacing right for tokenizers whose decoding depends on neighbouring tokens.
#[derive(Default, Debug, Clone)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    skip_special: bool,
    /// Tokens that end the text and are never part of it (with special tokens kept).
    enders: Vec<u32>,
}

impl IncrementalDecoder {
    pub fn new(skip_special: bool) -> Self {
        IncrementalDecoder {
            skip_special,
            ..Default::default()
        }
    }

    /// Special tokens stay in the text (a tool-call format's markers), all but the model's
    /// end-of-sequence tokens and `enders` (the request's stop token ids), which end it.
    pub fn keeping_special(enders: Vec<u32>) -> Self {
        IncrementalDecoder {
            skip_special: false,
            enders,
            ..Default::default()
        }
    }

    /// Adds one token; returns the text it completes, if any.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<Option<String>> {
        // Kept special tokens are markers inside the text; the one that ends it is not text.
        if !self.skip_special && (tok.is_eos(id) || self.enders.contains(&id)) {
            return Ok(None);
        }
        self.ids.push(id);
        let prefix = tok.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special,
        )?;
        let full = tok.decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') {
            let new = match full.get(prefix.len()..) {
                Some(s) if full.starts_with(&prefix) => s.to_string(),
                // Decoding changed earlier text (rare); emit only what follows the common prefix.
                _ => common_suffix_after(&prefix, &full),
            };
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            Ok(Some(new))
        } else {
            Ok(None)
        }
    }

    /// Whatever is still held back (incomplete characters at the very end become U+FFFD).
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<Option<String>> {
        if self.read_offset == self.ids.len() {
            return Ok(None);
        }
        let prefix = tok.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special,
        )?;
        let full = tok.decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        let rest = common_suffix_after(&prefix, &full);
        Ok((!rest.is_empty()).then_some(rest))
    }
}

fn common_suffix_after(prefix: &str, full: &str) -> String {
    let common = prefix
        .char_indices()
        .zip(full.chars())
        .take_while(|((_, a), b)| a == b)
        .last()
        .map(|((i, c), _)| i + c.len_utf8())
        .unwrap_or(0);
    full[common..].to_string()
}
