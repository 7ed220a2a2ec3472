//! The one mapping from a failure to an HTTP answer: status plus the OpenAI error body
//! `{"error": {"message", "type", "param", "code"}}`.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds, for 429 and 503.
    pub retry_after: Option<u32>,
}

#[derive(Serialize)]
struct Body<'a> {
    error: Inner<'a>,
}

#[derive(Serialize)]
struct Inner<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 400 for a field the caller got wrong.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError {
            param: Some(param.into()),
            ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }
    /// 400 not tied to one field (malformed JSON, say).
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "authentication_error", message)
            .with_code("invalid_api_key")
    }
    pub fn request_timeout(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            message,
        )
    }
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "permission_error", message)
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found_error", message)
    }
    pub fn model_not_found(model: &str) -> Self {
        ApiError {
            param: Some("model".into()),
            ..Self::not_found(format!("The model `{model}` does not exist"))
                .with_code("model_not_found")
        }
    }
    pub fn method_not_allowed() -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            "Method not allowed on this route",
        )
    }
    pub fn payload_too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("The request body exceeds {limit} bytes"),
        )
    }
    pub fn unsupported_media_type() -> Self {
        Self::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request_error",
            "Content-Type must be application/json",
        )
    }
    pub fn overloaded(retry_after: u32) -> Self {
        ApiError {
            retry_after: Some(retry_after),
            ..Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "The server has too many requests queued; retry later",
            )
            .with_code("queue_full")
        }
    }
    pub fn not_ready() -> Self {
        ApiError {
            retry_after: Some(5),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                "The model is still loading",
            )
        }
    }
    /// 503 while draining: another instance (or this one, restarted) will take the request.
    pub fn shutting_down() -> Self {
        ApiError {
            retry_after: Some(5),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                "The server is shutting down",
            )
        }
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// The JSON body alone (also sent as an SSE event when a stream fails midway).
    /// The OpenAI error body. Messages and parameter names can quote what the client sent (an
    /// unknown field's name, a parser's excerpt): both are clipped, so an error never grows
    /// with the request.
    pub fn body_json(&self) -> String {
        let b = Body {
            error: Inner {
                message: clip(&self.message, MAX_MESSAGE),
                kind: self.kind,
                param: self.param.as_deref().map(|p| clip(p, MAX_PARAM)),
                code: self.code,
            },
        };
        serde_json::to_string(&b).unwrap_or_else(|_| "{}".into())
    }
}

const MAX_MESSAGE: usize = 1024;
const MAX_PARAM: usize = 128;

/// `s` cut to at most `max` bytes on a character boundary.
fn clip(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (
            self.status,
            [(header::CONTENT_TYPE, "application/json")],
            self.body_json(),
        )
            .into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_quoting_a_huge_field_stay_small() {
        let field = "é".repeat(500_000);
        let e = ApiError::invalid(
            field.clone(),
            format!("unknown field `{field}`, expected one of `a`, `b`"),
        );
        let body = e.body_json();
        assert!(
            body.len() < 2 * (MAX_MESSAGE + MAX_PARAM),
            "{} bytes",
            body.len()
        );
        let v: serde_json::Value = serde_json::from_str(&body).expect("still JSON");
        assert!(
            v["error"]["message"]
                .as_str()
                .expect("message")
                .starts_with("unknown field")
        );
    }
}
