//! `/v1/models`, `/model_info`, `/tokenize`, `/detokenize`.

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::chat::chat_prompt;
use super::{body, check_model, prepare, ready};
use crate::server::error::ApiError;
use crate::server::protocol::{DetokenizeRequest, TokenizeRequest, parse_body};
use crate::server::state::Shared;

fn answer(r: Result<Response, ApiError>) -> Response {
    r.unwrap_or_else(|e| e.into_response())
}

pub async fn models(State(state): State<Shared>) -> Response {
    answer(ready(&state).map(|r| {
        Json(json!({
            "object": "list",
            "data": [{
                "id": r.model_id, "object": "model", "created": r.created, "owned_by": "kiln",
                "max_model_len": r.max_model_len,
            }],
        }))
        .into_response()
    }))
}

pub async fn model_info(State(state): State<Shared>) -> Response {
    answer(ready(&state).map(|r| {
        let c = r.model.config();
        Json(json!({
            "model": r.model_id,
            "path": state.opts.model_path,
            "architecture": format!("{:?}", c.arch),
            "context_length": r.max_model_len,
            "model_context_length": c.max_context,
            "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size,
            "num_layers": c.n_layers,
            "num_heads": c.n_heads,
            "num_kv_heads": c.n_kv_heads,
            "precision": r.model.precision,
            "device": r.model.device,
            "backend": r.model.backend,
            "eos_token_ids": r.model.tokenizer.eos_ids,
            "kv_cache_tokens": r.kv_tokens,
            "max_running_requests": state.opts.max_running,
            "speculative_algorithm": state.opts.spec.method,
            "overlap_schedule": state.opts.overlap_schedule,
            "prefix_cache": state.opts.prefix_cache,
            // `tool-parser`'s name of the tool-call format (null: requests with tools are 400s).
            "tool_call_parser": r.tool_parser,
            "reasoning_parser": state.opts.reasoning_parser,
        }))
        .into_response()
    }))
}

pub async fn tokenize(State(state): State<Shared>, raw: Result<Bytes, BytesRejection>) -> Response {
    let bytes = match body(raw, state.opts.max_body_bytes) {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let shared = state.clone();
    answer(prepare(&state, move || tokenize_body(&shared, &bytes)).await)
}

fn tokenize_body(state: &Shared, bytes: &[u8]) -> Result<Response, ApiError> {
    let req: TokenizeRequest = parse_body(bytes)?;
    let r = ready(state)?;
    check_model(&r, req.model.as_deref())?;
    let ids = match (&req.prompt, &req.messages) {
        (Some(p), None) => r
            .model
            .tokenizer
            .encode(p, req.add_special_tokens)
            .map_err(|e| ApiError::invalid("prompt", e.to_string()))?,
        (None, Some(m)) => chat_prompt(&r, m, None)?,
        _ => {
            return Err(ApiError::bad_request(
                "send exactly one of `prompt` and `messages`",
            ));
        }
    };
    Ok(Json(json!({
        "tokens": ids, "count": ids.len(), "max_model_len": r.max_model_len,
    }))
    .into_response())
}

pub async fn detokenize(
    State(state): State<Shared>,
    raw: Result<Bytes, BytesRejection>,
) -> Response {
    answer((|| {
        let bytes = body(raw, state.opts.max_body_bytes)?;
        let req: DetokenizeRequest = parse_body(&bytes)?;
        let r = ready(&state)?;
        check_model(&r, req.model.as_deref())?;
        let vocab = r.model.config().vocab_size;
        if let Some(bad) = req.tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::invalid(
                "tokens",
                format!("token id {bad} is outside the vocabulary ({vocab} tokens)"),
            ));
        }
        let text = r
            .model
            .tokenizer
            .decode(&req.tokens, false)
            .map_err(|e| ApiError::invalid("tokens", e.to_string()))?;
        Ok(Json(json!({"prompt": text})).into_response())
    })())
}
