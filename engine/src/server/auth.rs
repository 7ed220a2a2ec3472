//! Bearer-token authentication for the API routes, compared in constant time.

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use subtle::ConstantTimeEq;

use super::error::ApiError;
use super::state::Shared;

pub async fn require_api_key(State(state): State<Shared>, req: Request, next: Next) -> Response {
    let Some(key) = state.opts.api_key.as_deref() else {
        return next.run(req).await;
    };
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match given {
        None => ApiError::unauthorized("Missing API key: send it as `Authorization: Bearer <key>`")
            .into_response(),
        Some(g) if bool::from(g.as_bytes().ct_eq(key.as_bytes())) => next.run(req).await,
        Some(_) => ApiError::unauthorized("Incorrect API key provided").into_response(),
    }
}
