//! `POST /v1/completions`.

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::{body, check_model, completion_logprobs, limits, prepare, ready, request_id, usage};
use crate::server::constraints;
use crate::server::error::ApiError;
use crate::server::generation::{Choice, Delta, submit};
use crate::server::protocol::{CompletionRequest, Prompt, parse_body};
use crate::server::sse::{self, StreamSpec};
use crate::server::state::{Shared, unix_now};
use crate::server::validate::{check_text_fits, fit_prompt, plan, top_logprobs};

const ENDPOINT: &str = "/v1/completions";
/// OpenAI's default for the legacy completions endpoint.
const DEFAULT_MAX_TOKENS: usize = 16;

pub async fn handle(State(state): State<Shared>, raw: Result<Bytes, BytesRejection>) -> Response {
    match run(&state, raw).await {
        Ok(r) => r,
        Err(e) => {
            state.metrics.count_request(ENDPOINT, e.status.as_str());
            e.into_response()
        }
    }
}

async fn run(state: &Shared, raw: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let bytes = body(raw, state.opts.max_body_bytes)?;
    let shared = state.clone();
    // JSON and tokenization: off the async workers.
    let (ready, tops, p, prompts) = prepare(state, move || {
        let req: CompletionRequest = parse_body(&bytes)?;
        let ready = ready(&shared)?;
        check_model(&ready, req.model.as_deref())?;
        if req.echo {
            return Err(ApiError::invalid("echo", "`echo` is not supported"));
        }
        let lim = limits(&ready);
        let tops = top_logprobs("logprobs", req.logprobs)?;
        let mut p = plan(&req.knobs(), req.max_tokens, tops, &lim)?;
        p.params.guide = constraints::guide(&ready, &req.constraint_fields())?;
        let tok = &ready.model.tokenizer;
        let encode = |s: &str| {
            check_text_fits("prompt", tok.min_tokens(s), &lim)?;
            tok.encode(s, true)
                .map_err(|e| ApiError::invalid("prompt", e.to_string()))
        };
        let prompts: Vec<Vec<u32>> = match &req.prompt {
            Prompt::Text(s) => vec![encode(s)?],
            Prompt::Texts(v) => v.iter().map(|s| encode(s)).collect::<Result<_, _>>()?,
            Prompt::Ids(ids) => vec![ids.clone()],
            Prompt::IdLists(v) => v.clone(),
        };
        Ok((ready, tops, p, prompts))
    })
    .await?;
    let lim = limits(&ready);
    let tok = &ready.model.tokenizer;
    if prompts.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt list is empty"));
    }
    // Every prompt gets n sequences: the request as a whole stays within --max-n, streamed or
    // not, so one request cannot fill the queue.
    if prompts.len() * p.n > lim.max_n {
        return Err(ApiError::invalid(
            "n",
            format!(
                "{} prompts x n = {} is {} sequences; at most {} per request",
                prompts.len(),
                p.n,
                prompts.len() * p.n,
                lim.max_n
            ),
        ));
    }
    let vocab = lim.vocab_size;
    let mut choices: Vec<Choice> = Vec::new();
    let mut prompt_tokens = 0;
    for (k, ids) in prompts.iter().enumerate() {
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::invalid(
                "prompt",
                format!("token id {bad} is outside the vocabulary ({vocab} tokens)"),
            ));
        }
        let params = fit_prompt(&p, "prompt", ids.len(), Some(DEFAULT_MAX_TOKENS), &lim)?;
        // n choices per prompt, each with its own engine sequence.
        choices.extend(submit(&ready, ids, &params, &p.stops, p.n, k * p.n)?);
        prompt_tokens += ids.len() * p.n;
    }
    let id = request_id("cmpl");
    let created = unix_now();
    let model = ready.model_id.clone();
    let want_logprobs = tops.is_some();
    if p.stream {
        let (id2, model2, r2) = (id.clone(), model.clone(), ready.clone());
        let chunk = move |d: &Delta| -> Option<Value> {
            if d.text.is_empty() && d.finish.is_none() && !want_logprobs {
                return None;
            }
            let lp = want_logprobs.then(|| completion_logprobs(&r2.model.tokenizer, &d.tokens, 0));
            Some(json!({
                "id": id2, "object": "text_completion", "created": created, "model": model2,
                "choices": [{"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": d.finish}],
            }))
        };
        let usage_chunk = p.include_usage.then(|| {
            let (id, model) = (id.clone(), model.clone());
            Box::new(move |u: Value| {
                json!({"id": id, "object": "text_completion", "created": created, "model": model,
                       "choices": [], "usage": u})
            }) as sse::UsageFn
        });
        return Ok(sse::respond(
            choices,
            StreamSpec {
                preamble: vec![],
                chunk: Box::new(chunk),
                usage_chunk,
                prompt_tokens,
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
        let lp = want_logprobs.then(|| completion_logprobs(tok, &tokens, 0));
        out.push(json!({"index": c.index, "text": text, "logprobs": lp, "finish_reason": finish}));
    }
    state.metrics.count_request(ENDPOINT, "200");
    Ok(Json(json!({
        "id": id, "object": "text_completion", "created": created, "model": model,
        "choices": out, "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
    }))
    .into_response())
}
