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
    if state.ready.get().is_none() || state.canary_running.load(Ordering::SeqCst) {
        return ApiError::not_ready().into_response();
    }
    let Some(guard) = &state.opts.lock else {
        return (StatusCode::OK, axum::Json(json!({"status": "ready"}))).into_response();
    };
    let drift = state.drift.lock().map(|d| d.clone()).unwrap_or_default();
    let drifted = drift
        .iter()
        .any(|c| c.status == crate::doctor::Status::Fail);
    let body = json!({
        "status": "ready",
        "lock": guard.lock_file,
        "config": guard.chosen,
        "drifted": drifted,
        "drift": drift,
    });
    (StatusCode::OK, axum::Json(body)).into_response()
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
