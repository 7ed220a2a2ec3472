//! `POST /v1/chat/completions`: messages rendered with the model's own chat template.

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::{body, chat_logprobs, check_model, limits, prepare, ready, request_id, usage};
use crate::server::constraints;
use crate::server::error::ApiError;
use crate::server::generation::{Delta, submit};
use crate::server::protocol::{ChatRequest, Content, Message, parse_body};
use crate::server::sse::{self, StreamSpec};
use crate::server::state::{Ready, Shared, unix_now};
use crate::server::validate::{check_text_fits, fit_prompt, plan, top_logprobs};
use crate::tokenizer::ChatMessage;

const ENDPOINT: &str = "/v1/chat/completions";
const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

pub async fn handle(State(state): State<Shared>, raw: Result<Bytes, BytesRejection>) -> Response {
    match run(&state, raw).await {
        Ok(r) => r,
        Err(e) => {
            state.metrics.count_request(ENDPOINT, e.status.as_str());
            e.into_response()
        }
    }
}

/// Messages as the template sees them; every problem names `messages[i]`.
pub fn convert_messages(messages: &[Message]) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must hold at least one message",
        ));
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            if !ROLES.contains(&m.role.as_str()) {
                return Err(ApiError::invalid(
                    format!("messages[{i}].role"),
                    format!(
                        "unknown role `{}`; use one of {}",
                        m.role,
                        ROLES.join(", ")
                    ),
                ));
            }
            // The templates kiln renders know system, user and assistant; developer is OpenAI's
            // new name for system.
            let role = if m.role == "developer" { "system" } else { &m.role };
            let content = match &m.content {
                Some(Content::Text(t)) => t.clone(),
                Some(Content::Parts(parts)) => {
                    let mut text = String::new();
                    for (j, p) in parts.iter().enumerate() {
                        match (p.kind.as_str(), &p.text) {
                            ("text", Some(t)) => text.push_str(t),
                            _ => {
                                return Err(ApiError::invalid(
                                    format!("messages[{i}].content[{j}]"),
                                    format!(
                                        "content part of type `{}` is not supported; send text parts",
                                        p.kind
                                    ),
                                ));
                            }
                        }
                    }
                    text
                }
                None if m.role == "assistant" => String::new(),
                None => {
                    return Err(ApiError::invalid(
                        format!("messages[{i}].content"),
                        "`content` is required",
                    ));
                }
            };
            Ok(ChatMessage::new(role, content))
        })
        .collect()
}

/// The prompt ids of a conversation, ending where the assistant's reply begins.
pub fn chat_prompt(ready: &Ready, messages: &[Message]) -> Result<Vec<u32>, ApiError> {
    let msgs = convert_messages(messages)?;
    let tok = &ready.model.tokenizer;
    let template = tok.chat_template.as_ref().ok_or_else(|| {
        ApiError::bad_request("This model has no chat template; use /v1/completions")
    })?;
    let text = template
        .render(&msgs, true)
        .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
    check_text_fits("messages", tok.min_tokens(&text), &super::limits(ready))?;
    // The template writes BOS itself where the model wants it.
    tok.encode(&text, false)
        .map_err(|e| ApiError::invalid("messages", e.to_string()))
}

async fn run(state: &Shared, raw: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let bytes = body(raw, state.opts.max_body_bytes)?;
    let shared = state.clone();
    // JSON, the chat template and tokenization: off the async workers.
    let (ready, tops, p, ids) = prepare(state, move || {
        let req: ChatRequest = parse_body(&bytes)?;
        let ready = ready(&shared)?;
        check_model(&ready, req.model.as_deref())?;
        let lim = limits(&ready);
        let tops = if req.logprobs {
            Some(top_logprobs("top_logprobs", req.top_logprobs)?.unwrap_or(0))
        } else if req.top_logprobs.is_some() {
            return Err(ApiError::invalid(
                "top_logprobs",
                "`top_logprobs` needs `logprobs: true`",
            ));
        } else {
            None
        };
        let max_tokens = req.max_completion_tokens.or(req.max_tokens);
        let mut p = plan(&req.knobs(), max_tokens, tops, &lim)?;
        p.params.guide = constraints::guide(&ready, &req.constraint_fields())?;
        let ids = chat_prompt(&ready, &req.messages)?;
        Ok((ready, tops, p, ids))
    })
    .await?;
    let lim = limits(&ready);
    let params = fit_prompt(&p, "messages", ids.len(), None, &lim)?;
    let choices = submit(&ready, &ids, &params, &p.stops, p.n, 0)?;
    let prompt_tokens = ids.len();
    let id = request_id("chatcmpl");
    let created = unix_now();
    let model = ready.model_id.clone();
    let want_logprobs = tops.is_some();
    let tok = &ready.model.tokenizer;
    if p.stream {
        let chunk_of = {
            let (id, model) = (id.clone(), model.clone());
            move |choices: Value| {
                json!({"id": id, "object": "chat.completion.chunk", "created": created,
                       "model": model, "system_fingerprint": null, "choices": choices})
            }
        };
        let preamble = (0..p.n)
            .map(|i| {
                chunk_of(
                    json!([{"index": i, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": null, "finish_reason": null}]),
                )
            })
            .collect();
        let r2 = ready.clone();
        let c2 = chunk_of.clone();
        let chunk = move |d: &Delta| -> Option<Value> {
            if d.text.is_empty() && d.finish.is_none() && !want_logprobs {
                return None;
            }
            let delta = if d.text.is_empty() {
                json!({})
            } else {
                json!({"content": d.text})
            };
            let lp = want_logprobs
                .then(|| json!({"content": chat_logprobs(&r2.model.tokenizer, &d.tokens)}));
            Some(c2(
                json!([{"index": d.index, "delta": delta, "logprobs": lp,
                            "finish_reason": d.finish}]),
            ))
        };
        let usage_chunk = p.include_usage.then(|| {
            let c3 = chunk_of.clone();
            Box::new(move |u: Value| {
                let mut v = c3(json!([]));
                v["usage"] = u;
                v
            }) as sse::UsageFn
        });
        return Ok(sse::respond(
            choices,
            StreamSpec {
                preamble,
                chunk: Box::new(chunk),
                usage_chunk,
                prompt_tokens: prompt_tokens * p.n,
                endpoint: ENDPOINT,
                metrics: state.metrics.clone(),
                state: state.clone(),
            },
        ));
    }
    let mut out = Vec::with_capacity(choices.len());
    let mut completion_tokens = 0;
    let mut cached_tokens = 0;
    for mut c in choices {
        let Delta {
            text,
            tokens,
            finish,
            cached_tokens: cached,
            ..
        } = tokio::select! {
            d = c.collect() => d?,
            _ = state.cut_off() => return Err(ApiError::shutting_down()),
        };
        completion_tokens += tokens.len();
        cached_tokens += cached;
        let lp = want_logprobs.then(|| json!({"content": chat_logprobs(tok, &tokens)}));
        out.push(json!({
            "index": c.index,
            "message": {"role": "assistant", "content": text},
            "logprobs": lp,
            "finish_reason": finish,
        }));
    }
    state.metrics.count_request(ENDPOINT, "200");
    Ok(Json(json!({
        "id": id, "object": "chat.completion", "created": created, "model": model,
        "system_fingerprint": null,
        "choices": out, "usage": usage(prompt_tokens * p.n, completion_tokens, cached_tokens),
    }))
    .into_response())
}
