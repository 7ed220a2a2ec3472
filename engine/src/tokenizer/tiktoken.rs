//! A tiktoken vocabulary (`tiktoken.model`: base64 token bytes and rank per line) as a byte-level
//! BPE tokenizer: Kimi-K2's Hugging Face directory ships its tokenizer this way, with
//! `tokenization_kimi.py` giving the split pattern and `tokenizer_config.json` the special
//! tokens above the vocabulary.
//!
//! tiktoken merges, within each piece the pattern splits off, the adjacent pair whose joined
//! bytes have the lowest rank, and takes a piece that is itself a token whole. The same encoder
//! as a `tokenizers` BPE: each token's rank is its id, its merges are the splits into two tokens
//! ordered by the joined token's rank (Hugging Face's own tiktoken conversion), and
//! `ignore_merges` takes whole-piece tokens first.

use std::collections::HashMap;
use std::path::Path;

use base64::Engine;
use tokenizers::AddedToken;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};

use super::token_bytes::gpt2_byte_chars;
use crate::error::{Error, Result};

/// `tokenization_kimi.py`'s pattern: Han runs on their own, words split by case with Han kept
/// out of their letter classes, digits in threes, then punctuation and whitespace.
pub const KIMI_PATTERN: &str = concat!(
    r"[\p{Han}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"|\s*[\r\n]+",
    r"|\s+(?!\S)",
    r"|\s+",
);

/// Ids above the vocabulary that `tokenization_kimi.py` reserves for special tokens; those
/// `tokenizer_config.json` does not name are `<|reserved_token_{id}|>`.
pub const RESERVED_SPECIAL_TOKENS: usize = 256;

/// Token bytes by rank, read from `path`.
pub fn read_ranks(path: &Path) -> Result<Vec<Vec<u8>>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    // Ranks are 0..lines: a larger one is a broken file, not a reason to allocate.
    let n_lines = text.lines().filter(|l| !l.is_empty()).count();
    let mut tokens: Vec<Option<Vec<u8>>> = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.is_empty()) {
        let bad = |what: &str| Error::format(path, format!("line {}: {what}", i + 1));
        let (b64, rank) = line
            .split_once(' ')
            .ok_or_else(|| bad("expected `<base64 token> <rank>`"))?;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map_err(|e| bad(&format!("the token is not base64 ({e})")))?;
        let rank: usize = rank
            .trim()
            .parse()
            .map_err(|_| bad(&format!("rank `{rank}` is not a number")))?;
        if rank >= n_lines {
            return Err(bad(&format!(
                "rank {rank} is past the file's {n_lines} tokens"
            )));
        }
        if rank >= tokens.len() {
            tokens.resize(rank + 1, None);
        }
        if tokens[rank].replace(bytes).is_some() {
            return Err(bad(&format!("rank {rank} appears twice")));
        }
    }
    tokens
        .into_iter()
        .enumerate()
        .map(|(rank, t)| t.ok_or_else(|| Error::format(path, format!("no token has rank {rank}"))))
        .collect()
}

/// A token above the vocabulary: its text, its id, and whether it is special (skipped when
/// decoding with `skip_special`), as `added_tokens_decoder` says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Added {
    pub text: String,
    pub id: u32,
    pub special: bool,
}

/// The tokenizer of `ranks` (token bytes by id) split by `pattern`, with the `added` tokens at
/// their ids.
pub fn build(ranks: &[Vec<u8>], pattern: &str, added: &[Added]) -> Result<tokenizers::Tokenizer> {
    let chars = gpt2_byte_chars();
    let spell = |bytes: &[u8]| -> String { bytes.iter().map(|&b| chars[b as usize]).collect() };
    let id_of: HashMap<&[u8], u32> = ranks
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_slice(), i as u32))
        .collect();
    // Every split of a token into two tokens is a merge, ranked by the token it makes.
    let mut merges: Vec<(u32, u32, u32)> = Vec::new();
    for (rank, token) in ranks.iter().enumerate() {
        let start = merges.len();
        for cut in 1..token.len() {
            if let (Some(&l), Some(&r)) = (id_of.get(&token[..cut]), id_of.get(&token[cut..])) {
                merges.push((rank as u32, l, r));
            }
        }
        merges[start..].sort_by_key(|&(_, l, r)| (l, r));
    }
    let mut vocab: tokenizers::models::bpe::Vocab = ranks
        .iter()
        .enumerate()
        .map(|(i, t)| (spell(t), i as u32))
        .collect();
    for a in added {
        if let Some(taken) = vocab.insert(a.text.clone(), a.id) {
            return Err(Error::Tokenizer(format!(
                "added token {:?} (id {}) spells the same as token {taken}",
                a.text, a.id
            )));
        }
    }
    let merges = merges
        .into_iter()
        .map(|(_, l, r)| (spell(&ranks[l as usize]), spell(&ranks[r as usize])))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(true)
        .build()
        .map_err(|e| Error::Tokenizer(format!("building the tiktoken BPE: {e}")))?;
    let mut tok = tokenizers::Tokenizer::new(bpe);
    let split = Split::new(
        SplitPattern::Regex(pattern.to_string()),
        tokenizers::SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(|e| Error::Tokenizer(format!("bad split pattern: {e}")))?;
    tok.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(Sequence::new(vec![
        PreTokenizerWrapper::Split(split),
        PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, false)),
    ]))));
    tok.with_decoder(Some(ByteLevelDecoder::default()));
    let (special, plain): (Vec<&Added>, Vec<&Added>) = added.iter().partition(|a| a.special);
    let tokens = |list: Vec<&Added>, special: bool| -> Vec<AddedToken> {
        list.into_iter()
            .map(|a| AddedToken::from(a.text.clone(), special))
            .collect()
    };
    tok.add_special_tokens(&tokens(special, true));
    tok.add_tokens(&tokens(plain, false));
    Ok(tok)
}

/// The tokens above a vocabulary of `n_ranks`: `tokenizer_config.json`'s `added_tokens_decoder`
/// (id -> `{content, special}`, special unless it says otherwise), the rest of the reserved block
/// named `<|reserved_token_{id}|>`.
pub fn added_tokens(config: &serde_json::Value, n_ranks: usize, path: &Path) -> Result<Vec<Added>> {
    let mut named: HashMap<u32, (String, bool)> = HashMap::new();
    let top = n_ranks + RESERVED_SPECIAL_TOKENS;
    if let Some(decoder) = config
        .get("added_tokens_decoder")
        .and_then(|d| d.as_object())
    {
        for (id, token) in decoder {
            let bad =
                |what: String| Error::format(path, format!("added_tokens_decoder.{id}: {what}"));
            let id: u32 = id
                .parse()
                .map_err(|_| bad("the key is not a token id".into()))?;
            let content = token
                .get("content")
                .and_then(|c| c.as_str())
                .ok_or_else(|| bad("has no `content` string".into()))?;
            if !(n_ranks..top).contains(&(id as usize)) {
                return Err(bad(format!(
                    "id {id} is outside the {RESERVED_SPECIAL_TOKENS} ids after the tiktoken \
                     vocabulary ({n_ranks}..{top})"
                )));
            }
            let special = token
                .get("special")
                .and_then(|s| s.as_bool())
                .unwrap_or(true);
            named.insert(id, (content.to_string(), special));
        }
    }
    Ok((n_ranks..top)
        .map(|id| {
            let id = id as u32;
            let (text, special) = named
                .remove(&id)
                .unwrap_or_else(|| (format!("<|reserved_token_{id}|>"), true));
            Added { text, id, special }
        })
        .collect())
}
