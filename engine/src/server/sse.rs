//! Streaming responses: a task drives the choices and feeds server-sent events through a small
//! channel. When the client goes away the channel closes, the task ends, its choices are dropped,
//! and the engine frees their KV blocks at its next step.

use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde_json::Value;
use tokio::sync::mpsc;

use super::error::ApiError;
use super::generation::{Choice, Delta};
use crate::metrics::Metrics;

/// Formats one delta as a chunk (`None`: nothing to send).
pub type ChunkFn = Box<dyn FnMut(&Delta) -> Option<Value> + Send>;
/// Formats the final usage chunk.
pub type UsageFn = Box<dyn Fn(Value) -> Value + Send>;

pub struct StreamSpec {
    /// Sent before any token (chat's `role` chunk, say).
    pub preamble: Vec<Value>,
    /// One chunk per delta (`None`: nothing to send).
    pub chunk: ChunkFn,
    /// With `include_usage`: the final chunk given the usage object.
    pub usage_chunk: Option<UsageFn>,
    pub prompt_tokens: usize,
    pub endpoint: &'static str,
    pub metrics: Arc<Metrics>,
    /// The server, whose shutdown timeout may cut the stream.
    pub state: super::state::Shared,
}

pub fn respond(choices: Vec<Choice>, spec: StreamSpec) -> Response {
    let (tx, rx) = mpsc::channel::<Event>(64);
    tokio::spawn(drive(choices, spec, tx));
    let events = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|e| (Ok::<_, Infallible>(e), rx))
    });
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

async fn drive(choices: Vec<Choice>, mut spec: StreamSpec, tx: mpsc::Sender<Event>) {
    let send = |v: &Value| Event::default().data(v.to_string());
    for p in &spec.preamble {
        if tx.send(send(p)).await.is_err() {
            spec.metrics.count_request(spec.endpoint, "aborted");
            return;
        }
    }
    let mut merged = futures::stream::select_all(choices.into_iter().map(|c| {
        Box::pin(futures::stream::unfold(c, |mut c| async move {
            let d = c.next().await?;
            Some((d, c))
        }))
    }));
    let mut completion = 0;
    let mut cached = 0;
    loop {
        let d = tokio::select! {
            d = merged.next() => match d {
                Some(d) => d,
                None => break,
            },
            _ = spec.state.cut_off() => {
                // Cut by the shutdown timeout: an error event the client can read, then the
                // end marker every client waits for.
                spec.metrics.count_request(spec.endpoint, "503");
                let _ = tx
                    .send(Event::default().data(ApiError::shutting_down().body_json()))
                    .await;
                let _ = tx.send(Event::default().data("[DONE]")).await;
                return;
            }
        };
        let event = match d {
            Ok(d) => {
                completion += d.tokens.len();
                cached += d.cached_tokens;
                match (spec.chunk)(&d) {
                    Some(v) => send(&v),
                    None => continue,
                }
            }
            Err(e) => {
                spec.metrics.count_request(spec.endpoint, "500");
                let _ = tx.send(Event::default().data(e.body_json())).await;
                return;
            }
        };
        if tx.send(event).await.is_err() {
            spec.metrics.count_request(spec.endpoint, "aborted");
            return;
        }
    }
    if let Some(u) = &spec.usage_chunk {
        let usage = super::routes::usage(spec.prompt_tokens, completion, cached);
        if tx.send(send(&u(usage))).await.is_err() {
            spec.metrics.count_request(spec.endpoint, "aborted");
            return;
        }
    }
    let _ = tx.send(Event::default().data("[DONE]")).await;
    spec.metrics.count_request(spec.endpoint, "200");
}
