//! Structured outputs: a request's JSON schema, regex or Lark grammar becomes a matcher over
//! kiln's vocabulary (the `llguidance` crate), which says before every sampled token which tokens
//! may come next and follows the tokens the request emits.

use std::sync::{Arc, Mutex};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::{Value, json};

use crate::sampling::{TokenGuide, TokenMask};
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
            error: None,
        })
    }
}

/// One sequence's matcher: the mask before each token (and after each draft the runner
/// proposes), then the token it emitted. Its first failure is kept and fails the request.
pub struct Guide {
    matcher: Matcher,
    eos: Arc<[u32]>,
    matcher_eos: u32,
    width: usize,
    error: Option<String>,
}

impl Clone for Guide {
    fn clone(&self) -> Self {
        Guide {
            matcher: self.matcher.deep_clone(),
            eos: self.eos.clone(),
            matcher_eos: self.matcher_eos,
            width: self.width,
            error: self.error.clone(),
        }
    }
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guide")
            .field("stopped", &self.matcher.is_stopped())
            .field("error", &self.error)
            .finish()
    }
}

impl Guide {
    /// The tokens allowed next. Where the grammar may end, every end-of-sequence id is allowed
    /// (the model ends a chat turn with its own). A matcher that fails allows nothing.
    pub fn mask(&mut self) -> TokenMask {
        if self.error.is_some() {
            return self.nothing();
        }
        let vob = match self.matcher.compute_mask_or_eos() {
            Ok(v) => v,
            Err(e) => return self.fail(e.to_string()),
        };
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
        mask
    }

    /// The mask after `path` (draft tokens), the matcher left where it was: it takes the path,
    /// answers, and rolls back. A path the grammar refuses gets a mask allowing nothing.
    pub fn mask_after(&mut self, path: &[u32]) -> TokenMask {
        if path.is_empty() || self.error.is_some() {
            return self.mask();
        }
        // Nothing follows an end-of-sequence token (the request ends there), and the matcher
        // must not take one here: it may take it without recording it, and the rollback below
        // would then undo a token the request really emitted.
        let Some(path) = path
            .iter()
            .all(|t| !self.eos.contains(t))
            .then(|| self.matcher_tokens(path))
        else {
            return self.nothing();
        };
        let taken = match self.matcher.try_consume_tokens(&path) {
            Ok(n) => n,
            Err(e) => return self.fail(e.to_string()),
        };
        let mask = if taken == path.len() {
            self.mask()
        } else {
            self.nothing()
        };
        if let Err(e) = self.matcher.rollback(taken) {
            return self.fail(e.to_string());
        }
        mask
    }

    /// How many of `drafts`, in order, the grammar admits (the matcher does not move).
    pub fn admits(&mut self, drafts: &[u32]) -> usize {
        if drafts.is_empty() || self.error.is_some() {
            return 0;
        }
        let drafts = self.matcher_tokens(drafts);
        match self.matcher.validate_tokens(&drafts) {
            Ok(n) => n,
            Err(e) => {
                self.fail(e.to_string());
                0
            }
        }
    }

    /// Follows an emitted token (any end-of-sequence id counts as the matcher's own). A token
    /// it refuses is a failure (the mask allowed it, so this is a bug or a lost matcher).
    pub fn advance(&mut self, token: u32) {
        if self.error.is_some() {
            return;
        }
        let token = self.matcher_tokens(&[token])[0];
        if let Err(e) = self.matcher.consume_token(token) {
            self.fail(e.to_string());
        }
    }

    /// The grammar is complete and admits nothing more.
    pub fn finished(&self) -> bool {
        self.error.is_none() && self.matcher.is_stopped()
    }

    /// Why the matcher failed, if it did.
    pub fn error(&self) -> Option<&str> {
        self.error.as_deref()
    }

    fn matcher_tokens(&self, tokens: &[u32]) -> Vec<u32> {
        tokens
            .iter()
            .map(|t| {
                if self.eos.contains(t) {
                    self.matcher_eos
                } else {
                    *t
                }
            })
            .collect()
    }

    fn nothing(&self) -> TokenMask {
        TokenMask::allowing(self.width, [])
    }

    fn fail(&mut self, e: String) -> TokenMask {
        self.error.get_or_insert(e);
        self.nothing()
    }
}

/// The runner's view of a guide: shared with the step, which asks it from its own thread while
/// the forward runs.
impl TokenGuide for Mutex<Guide> {
    fn admits(&self, drafts: &[u32]) -> usize {
        locked(self).admits(drafts)
    }

    fn mask_after(&self, path: &[u32]) -> TokenMask {
        locked(self).mask_after(path)
    }
}

/// The guide behind a lock. A panic while it was held (caught and reported as a failed step)
/// leaves a matcher that is still whole, so poisoning is ignored.
fn locked(m: &Mutex<Guide>) -> std::sync::MutexGuard<'_, Guide> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The guide, for the engine that owns it between steps.
pub fn guide_mut(m: &mut Mutex<Guide>) -> &mut Guide {
    m.get_mut().unwrap_or_else(|e| e.into_inner())
}
