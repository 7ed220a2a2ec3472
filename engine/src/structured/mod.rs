//! Structured outputs: a request's JSON schema, regex or Lark grammar becomes a matcher over
//! kiln's vocabulary (the `llguidance` crate), which says before every sampled token which tokens
//! may come next and follows the tokens the request emits.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::{Value, json};

use crate::sampling::TokenMask;
use crate::tokenizer::Tokenizer;

/// What a request constrains its output to.
#[derive(Clone, Debug, PartialEq)]
pub enum Constraint {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid against this schema.
    JsonSchema(Value),
    /// Text matching this regular expression (Rust `regex` syntax), whole.
    Regex(String),
    /// Text of this grammar, in llguidance's Lark dialect.
    Lark(String),
}

impl Constraint {
    fn grammar(&self) -> TopLevelGrammar {
        match self {
            Constraint::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(json!({"type": "object"})))
            }
            Constraint::JsonSchema(s) => TopLevelGrammar::from_json_schema(compact(s.clone())),
            Constraint::Regex(r) => TopLevelGrammar::from_regex(r),
            Constraint::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        }
    }
}

/// JSON as `json.dumps` writes it (`", "` and `": "`, no other whitespace) unless the schema
/// says otherwise: free whitespace lets a small model pad its output with newlines until
/// `max_tokens` cuts it.
pub fn compact(mut schema: Value) -> Value {
    if let Value::Object(o) = &mut schema
        && !o.contains_key("x-guidance")
    {
        o.insert(
            "x-guidance".into(),
            json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    schema
}

/// Compiles constraints against one model's vocabulary. Built once per model, on the first
/// constrained request (the token table covers the whole vocabulary).
pub struct Grammars {
    factory: ParserFactory,
    /// Every id that ends generation; the matcher knows one of them as its end token.
    eos: Arc<[u32]>,
    matcher_eos: u32,
    /// Logit rows' width (the model's vocabulary, which may exceed the tokenizer's).
    width: usize,
}

impl Grammars {
    pub fn new(tok: &Tokenizer, width: usize) -> Result<Grammars, String> {
        let matcher_eos = *tok
            .eos_ids
            .first()
            .ok_or("the tokenizer names no end-of-sequence token")?;
        let mut words = tok.token_bytes();
        words.resize(width.max(words.len()), Vec::new());
        let info = TokRxInfo::new(words.len() as u32, matcher_eos);
        let trie = TokTrie::from(&info, &words);
        let env: llguidance::toktrie::TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        Ok(Grammars {
            factory,
            eos: tok.eos_ids.clone().into(),
            matcher_eos,
            width,
        })
    }

    /// A fresh matcher for `c`; an invalid schema, regex or grammar is an error naming the fault.
    pub fn guide(&self, c: &Constraint) -> Result<Guide, String> {
        let parser = self
            .factory
            .create_parser(c.grammar())
            .map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(Guide {
            matcher,
            eos: self.eos.clone(),
            matcher_eos: self.matcher_eos,
            width: self.width,
        })
    }
}

/// One sequence's matcher: the mask before each token, then the token.
pub struct Guide {
    matcher: Matcher,
    eos: Arc<[u32]>,
    matcher_eos: u32,
    width: usize,
}

impl Clone for Guide {
    fn clone(&self) -> Self {
        Guide {
            matcher: self.matcher.deep_clone(),
            eos: self.eos.clone(),
            matcher_eos: self.matcher_eos,
            width: self.width,
        }
    }
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guide")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

impl Guide {
    /// The tokens allowed next. Where the grammar may end, every end-of-sequence id is allowed
    /// (the model ends a chat turn with its own).
    pub fn mask(&mut self) -> Result<TokenMask, String> {
        let vob = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| e.to_string())?;
        let words32 = vob.as_slice();
        let mut words: Vec<u64> = words32
            .chunks(2)
            .map(|p| u64::from(p[0]) | p.get(1).map_or(0, |&hi| u64::from(hi) << 32))
            .collect();
        words.resize(self.width.div_ceil(64), 0);
        let mut mask = TokenMask::from_words(words, self.width);
        if mask.allows(self.matcher_eos) {
            for &e in self.eos.iter() {
                mask.allow(e);
            }
        }
        Ok(mask)
    }

    /// Follows an emitted token (any end-of-sequence id counts as the matcher's own).
    pub fn advance(&mut self, token: u32) -> Result<(), String> {
        let token = if self.eos.contains(&token) {
            self.matcher_eos
        } else {
            token
        };
        self.matcher.consume_token(token).map_err(|e| e.to_string())
    }

    /// The grammar is complete and admits nothing more.
    pub fn finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}
