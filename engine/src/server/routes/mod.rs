//! One file per group of routes; the helpers every generation route shares.

pub mod chat;
pub mod completions;
pub mod health;
pub mod info;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use serde_json::{Value, json};

use super::error::ApiError;
use super::state::{AppState, Ready};
use super::validate::Limits;
use crate::sampling::Sampled;
use crate::tokenizer::Tokenizer;

/// The model, or 503 while it loads or the server drains.
pub fn ready(state: &AppState) -> Result<Arc<Ready>, ApiError> {
    if state.draining.load(Ordering::SeqCst) {
        return Err(ApiError::shutting_down());
    }
    state.ready.get().cloned().ok_or_else(ApiError::not_ready)
}

/// Runs a request's preparation (JSON, chat template, tokenization) on the blocking pool, a few
/// at a time: a burst of large bodies neither stalls the async workers (`/health`, live
/// streams) nor holds more than a few expanded copies in memory at once.
pub async fn prepare<T: Send + 'static>(
    state: &AppState,
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let _permit = state
        .prep
        .acquire()
        .await
        .map_err(|_| ApiError::shutting_down())?;
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal(format!("preparing the request failed: {e}")))?
}

/// The body bytes, or 413 past the size limit.
pub fn body(body: Result<Bytes, BytesRejection>, limit: usize) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::payload_too_large(limit)
        } else if super::guard::timed_out(&e) {
            ApiError::request_timeout("The request body did not arrive within --body-timeout")
        } else {
            ApiError::bad_request(format!("Could not read the request body: {e}"))
        }
    })
}

/// `model` may be omitted; when given it must name the served model.
pub fn check_model(ready: &Ready, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != ready.model_id => Err(ApiError::model_not_found(m)),
        _ => Ok(()),
    }
}

pub fn limits(ready: &Ready) -> Limits {
    Limits {
        max_model_len: ready.max_model_len,
        vocab_size: ready.model.config().vocab_size,
        max_n: ready.max_n,
    }
}

pub fn token_text(tok: &Tokenizer, id: u32) -> String {
    tok.decode(&[id], false).unwrap_or_default()
}

/// Chat-style logprobs entries: `{token, logprob, bytes, top_logprobs}`.
pub fn chat_logprobs(tok: &Tokenizer, tokens: &[Sampled]) -> Vec<Value> {
    let entry = |id: u32, lp: f32| {
        let t = token_text(tok, id);
        json!({"token": t, "logprob": lp, "bytes": t.as_bytes()})
    };
    tokens
        .iter()
        .map(|s| {
            let mut e = entry(s.token, s.logprob);
            e["top_logprobs"] = s.top.iter().map(|&(i, l)| entry(i, l)).collect();
            e
        })
        .collect()
}

/// Completions-style logprobs: parallel arrays.
pub fn completion_logprobs(tok: &Tokenizer, tokens: &[Sampled], text_start: usize) -> Value {
    let mut offset = text_start;
    let mut texts = Vec::new();
    let mut offsets = Vec::new();
    for s in tokens {
        let t = token_text(tok, s.token);
        offsets.push(offset);
        offset += t.len();
        texts.push(t);
    }
    let tops: Vec<Value> = tokens
        .iter()
        .map(|s| {
            let m: serde_json::Map<String, Value> = s
                .top
                .iter()
                .map(|&(i, l)| (token_text(tok, i), json!(l)))
                .collect();
            Value::Object(m)
        })
        .collect();
    json!({
        "tokens": texts,
        "token_logprobs": tokens.iter().map(|s| s.logprob).collect::<Vec<_>>(),
        "top_logprobs": tops,
        "text_offset": offsets,
    })
}

/// OpenAI's usage object; `cached` prompt tokens came from the prefix cache.
pub fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

/// A short random id, as OpenAI's `chatcmpl-...`.
pub fn request_id(prefix: &str) -> String {
    use rand::Rng;
    let mut rng = rand::rng();
    let s: String = (0..24)
        .map(|_| {
            let c = rng.random_range(0..62u8);
            (match c {
                0..=9 => b'0' + c,
                10..=35 => b'a' + c - 10,
                _ => b'A' + c - 36,
            }) as char
        })
        .collect();
    format!("{prefix}-{s}")
}
