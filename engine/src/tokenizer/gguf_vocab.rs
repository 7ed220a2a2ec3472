//! Rebuilds a byte-level BPE tokenizer (GPT-2 style, `tokenizer.ggml.model = gpt2`) from GGUF metadata:
//! tokens, merges, token types and the pre-tokenizer named by `tokenizer.ggml.pre`.

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use crate::error::{Error, Result};
use crate::weights::gguf::{GgufFile, MetaValue};

pub struct Built {
    pub tokenizer: tokenizers::Tokenizer,
    pub bos_id: Option<u32>,
    pub bos_text: Option<String>,
    pub eos_ids: Vec<u32>,
    pub eos_text: Option<String>,
    pub add_bos: bool,
}

/// Qwen2's pattern: single digits, letters with one optional leading non-letter.
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3's pattern: digits in groups of up to three.
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// DeepSeek-V3's three splits in order (llama.cpp's `deepseek-v3`, its tokenizer.json's
/// `Split`s): digit runs of up to three, CJK runs, then letters / punctuation / whitespace.
const DEEPSEEK3_PATTERNS: [&str; 3] = [
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
];

const TOKEN_TYPE_CONTROL: u64 = 3;
const TOKEN_TYPE_USER_DEFINED: u64 = 4;

fn strings(g: &GgufFile, key: &str) -> Result<Vec<String>> {
    let arr = g.meta(key).and_then(|v| v.as_array()).ok_or_else(|| {
        Error::format(
            &g.path,
            format!("metadata `{key}` is missing or not an array"),
        )
    })?;
    arr.iter()
        .map(|v| match v {
            MetaValue::Str(s) => Ok(s.clone()),
            _ => Err(Error::format(
                &g.path,
                format!("metadata `{key}` holds a non-string"),
            )),
        })
        .collect()
}

fn split(pattern: &str) -> Result<PreTokenizerWrapper> {
    let s = Split::new(
        SplitPattern::Regex(pattern.to_string()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(|e| Error::Tokenizer(format!("bad split pattern: {e}")))?;
    Ok(PreTokenizerWrapper::Split(s))
}

fn pre_tokenizer(g: &GgufFile, pre: &str) -> Result<PreTokenizerWrapper> {
    let byte_level =
        |use_regex| PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, use_regex));
    Ok(match pre {
        "default" | "gpt2" | "gpt-2" => byte_level(true),
        // SmolLM's tokenizer.json: every digit on its own, then GPT-2 splitting.
        "smollm" | "starcoder" | "refact" => PreTokenizerWrapper::Sequence(Sequence::new(vec![
            PreTokenizerWrapper::Digits(Digits::new(true)),
            byte_level(true),
        ])),
        "qwen2" | "deepseek-r1-qwen" => PreTokenizerWrapper::Sequence(Sequence::new(vec![
            split(QWEN2_PATTERN)?,
            byte_level(false),
        ])),
        "deepseek-v3" => PreTokenizerWrapper::Sequence(Sequence::new(vec![
            split(DEEPSEEK3_PATTERNS[0])?,
            split(DEEPSEEK3_PATTERNS[1])?,
            split(DEEPSEEK3_PATTERNS[2])?,
            byte_level(false),
        ])),
        "llama3" | "llama-bpe" | "smaug-bpe" | "dbrx" => {
            PreTokenizerWrapper::Sequence(Sequence::new(vec![
                split(LLAMA3_PATTERN)?,
                byte_level(false),
            ]))
        }
        other => {
            return Err(Error::format(
                &g.path,
                format!("tokenizer pre-tokenizer `tokenizer.ggml.pre = {other}` is not supported"),
            ));
        }
    })
}

/// `pre`: the pre-tokenizer to use instead of the file's `tokenizer.ggml.pre` (None: the file's).
pub fn build(g: &GgufFile, pre: Option<&str>) -> Result<Built> {
    let model = g.meta_str("tokenizer.ggml.model").unwrap_or("");
    if model != "gpt2" {
        return Err(Error::format(
            &g.path,
            format!(
                "GGUF tokenizer `tokenizer.ggml.model = {model}` is not supported (byte-level BPE `gpt2` is); \
                 load the model's Hugging Face directory with its tokenizer.json instead"
            ),
        ));
    }
    let tokens = strings(g, "tokenizer.ggml.tokens")?;
    let merges_raw = strings(g, "tokenizer.ggml.merges")?;
    let types: Vec<u64> = g
        .meta("tokenizer.ggml.token_type")
        .and_then(|v| v.as_array())
        .map(|a| a.iter().map(|v| v.as_u64().unwrap_or(1)).collect())
        .unwrap_or_else(|| vec![1; tokens.len()]);
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let mut merges = Vec::with_capacity(merges_raw.len());
    for m in &merges_raw {
        let (a, b) = m.split_once(' ').ok_or_else(|| {
            Error::format(
                &g.path,
                format!("merge `{m}` in `tokenizer.ggml.merges` has no space"),
            )
        })?;
        merges.push((a.to_string(), b.to_string()));
    }
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| Error::Tokenizer(format!("{}: building BPE: {e}", g.path.display())))?;
    let mut tok = tokenizers::Tokenizer::new(bpe);
    let pre = pre
        .or_else(|| g.meta_str("tokenizer.ggml.pre"))
        .unwrap_or("default");
    tok.with_pre_tokenizer(Some(pre_tokenizer(g, pre)?));
    tok.with_decoder(Some(ByteLevelDecoder::default()));
    let mut special = Vec::new();
    let mut user = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        match types.get(i).copied().unwrap_or(1) {
            TOKEN_TYPE_CONTROL => special.push(AddedToken::from(t.clone(), true)),
            TOKEN_TYPE_USER_DEFINED => user.push(AddedToken::from(t.clone(), false)),
            _ => {}
        }
    }
    tok.add_special_tokens(&special);
    tok.add_tokens(&user);
    let id = |key: &str| {
        g.meta_u64(key)
            .map(|v| v as u32)
            .filter(|&v| (v as usize) < tokens.len())
    };
    let bos_id = id("tokenizer.ggml.bos_token_id");
    let eos_id = id("tokenizer.ggml.eos_token_id");
    let mut eos_ids: Vec<u32> = eos_id
        .into_iter()
        .chain(id("tokenizer.ggml.eot_token_id"))
        .collect();
    eos_ids.sort_unstable();
    eos_ids.dedup();
    Ok(Built {
        tokenizer: tok,
        bos_text: bos_id.map(|i| tokens[i as usize].clone()),
        eos_text: eos_id.map(|i| tokens[i as usize].clone()),
        bos_id,
        eos_ids,
        add_bos: g
            .meta("tokenizer.ggml.add_bos_token")
            .and_then(|v| v.as_bool())
            .unwrap_or(false),
    })
}
