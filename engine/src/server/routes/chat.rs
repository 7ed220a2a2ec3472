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
use crate::server::protocol::{ChatRequest, Content, Message, MessageToolCall, parse_body};
use crate::server::reasoning::Reasoning;
use crate::server::sse::{self, StreamSpec};
use crate::server::state::{Ready, Shared, unix_now};
use crate::server::tools::{StreamCalls, Tools, parse_complete};
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
            let mut msg = ChatMessage::new(role, content);
            msg.name = m.name.clone();
            msg.tool_call_id = m.tool_call_id.clone();
            if let Some(calls) = &m.tool_calls {
                if m.role != "assistant" {
                    return Err(ApiError::invalid(
                        format!("messages[{i}].tool_calls"),
                        "only assistant messages carry `tool_calls`",
                    ));
                }
                msg.tool_calls = Some(calls.iter().map(template_call).collect());
            }
            Ok(msg)
        })
        .collect()
}

/// A call of the history as chat templates read it: arguments as an object (OpenAI sends a
/// string of JSON; transformers' templates expect the object), a string that is not JSON kept.
fn template_call(c: &MessageToolCall) -> Value {
    let arguments = match &c.function.arguments {
        Value::String(text) => {
            serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.clone()))
        }
        other => other.clone(),
    };
    json!({"id": c.id, "type": c.kind.as_deref().unwrap_or("function"),
           "function": {"name": c.function.name, "arguments": arguments}})
}

/// Templates that join a call's arguments to text with `+` (DeepSeek-V3, R1 and V3.1) need them
/// as the JSON string OpenAI sent; the others read an object (transformers' convention).
fn concatenates_arguments(template: &str) -> bool {
    ["['arguments'] +", "['arguments']+", ".arguments +"]
        .iter()
        .any(|p| template.contains(p))
}

/// The prompt ids of a conversation, ending where the assistant's reply begins.
pub fn chat_prompt(
    ready: &Ready,
    messages: &[Message],
    tools: Option<&[Value]>,
) -> Result<Vec<u32>, ApiError> {
    let mut msgs = convert_messages(messages)?;
    let tok = &ready.model.tokenizer;
    let template = tok.chat_template.as_ref().ok_or_else(|| {
        ApiError::bad_request("This model has no chat template; use /v1/completions")
    })?;
    if concatenates_arguments(template.source()) {
        for call in msgs
            .iter_mut()
            .flat_map(|m| m.tool_calls.iter_mut().flatten())
        {
            let args = &mut call["function"]["arguments"];
            if !args.is_string() {
                *args = Value::String(args.to_string());
            }
        }
    }
    let text = template
        .render_with_tools(&msgs, tools, true)
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
    let (ready, tops, p, ids, tools) = prepare(state, move || {
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
        let tools = Tools::of(&req, ready.tool_parser)?;
        p.params.guide = constraints::guide(&ready, &req.constraint_fields())?;
        let special = |marker: &str| ready.model.tokenizer.special_id(marker);
        if let Some(c) = tools
            .as_ref()
            .map(|t| t.constraint(&special))
            .transpose()?
            .flatten()
        {
            if p.params.guide.is_some() {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "a forced tool call and an output format cannot both constrain one reply",
                ));
            }
            p.params.guide = Some(constraints::compile(&ready, "tool_choice", &c)?);
        }
        p.params.keep_special = tools.as_ref().is_some_and(Tools::keeps_special);
        let defs = tools.as_ref().map(Tools::template_values);
        let ids = chat_prompt(&ready, &req.messages, defs.as_deref())?;
        Ok((ready, tops, p, ids, tools.filter(Tools::parses)))
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
        let mut calls: Vec<Option<StreamCalls>> = (0..p.n)
            .map(|_| tools.as_ref().and_then(StreamCalls::new))
            .collect();
        let mut thinking: Vec<Option<Reasoning>> = (0..p.n)
            .map(|_| state.opts.reasoning_parser.and_then(Reasoning::new))
            .collect();
        let chunk = move |d: &Delta| -> Option<Value> {
            let last = d.finish.is_some();
            let (reasoning, answer) = match thinking.get_mut(d.index).and_then(Option::as_mut) {
                Some(r) => r.feed(&d.text, last),
                None => (String::new(), d.text.clone()),
            };
            let (text, tool_deltas, called) = match calls.get_mut(d.index).and_then(Option::as_mut)
            {
                Some(c) => {
                    let (text, deltas) = c.feed(&answer, last);
                    (text, deltas, c.called())
                }
                None => (answer, Vec::new(), false),
            };
            if text.is_empty()
                && reasoning.is_empty()
                && tool_deltas.is_empty()
                && !last
                && !want_logprobs
            {
                return None;
            }
            let mut delta = json!({});
            if !reasoning.is_empty() {
                delta["reasoning_content"] = json!(reasoning);
            }
            if !text.is_empty() {
                delta["content"] = json!(text);
            }
            if !tool_deltas.is_empty() {
                delta["tool_calls"] = json!(tool_deltas);
            }
            let finish = match d.finish {
                Some("stop") if called => Some("tool_calls"),
                other => other,
            };
            let lp = want_logprobs
                .then(|| json!({"content": chat_logprobs(&r2.model.tokenizer, &d.tokens)}));
            Some(c2(
                json!([{"index": d.index, "delta": delta, "logprobs": lp,
                            "finish_reason": finish}]),
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
        let (reasoning, text) = match state.opts.reasoning_parser.and_then(Reasoning::new) {
            Some(mut r) => r.split(&text),
            None => (None, text),
        };
        let (mut message, finish) = match tools.as_ref().map(|t| parse_complete(t, &text)) {
            Some((content, calls)) if !calls.is_empty() => (
                json!({"role": "assistant", "content": content, "tool_calls": calls}),
                if finish == Some("stop") {
                    Some("tool_calls")
                } else {
                    finish
                },
            ),
            _ => (json!({"role": "assistant", "content": text}), finish),
        };
        if let Some(r) = reasoning {
            message["reasoning_content"] = json!(r);
        }
        out.push(json!({
            "index": c.index,
            "message": message,
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
