//! Liveness, readiness and metrics: answered from the moment the port is bound, before the model
//! has loaded, and never behind the API key.

use std::sync::atomic::Ordering;

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::server::error::ApiError;
use crate::server::state::Shared;

/// Alive while the process can answer and the engine loop is turning.
pub async fn health(State(state): State<Shared>) -> Response {
    match state.ready.get() {
        Some(r) if r.engine.since_heartbeat().as_secs() > 60 => {
            ApiError::internal("the engine loop has not turned for a minute").into_response()
        }
        _ => (StatusCode::OK, axum::Json(json!({"status": "ok"}))).into_response(),
    }
}

/// 200 once the model is loaded and warmed up; 503 while loading and while draining.
pub async fn ready(State(state): State<Shared>) -> Response {
    if state.draining.load(Ordering::SeqCst) {
        return ApiError::shutting_down().into_response();
    }
    match state.ready.get() {
        Some(_) => (StatusCode::OK, axum::Json(json!({"status": "ready"}))).into_response(),
        None => ApiError::not_ready().into_response(),
    }
}

pub async fn metrics(State(state): State<Shared>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.render(),
    )
        .into_response()
}
