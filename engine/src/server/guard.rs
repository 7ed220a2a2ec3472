//! What every request passes before a route sees it: a declared body far over the limit, or one
//! a client asks leave to send (`Expect: 100-continue`), is refused before a byte of it is read
//! (no `100 Continue`); and browsers cannot drive the server from a web page: a request carrying
//! an `Origin` that `--allowed-origins` does not list is refused (browsers send `Origin` on every
//! cross-site POST; curl and the SDKs send none), and on a loopback bind only loopback `Host`
//! names are served (a DNS-rebinding page reaches 127.0.0.1 under its own host name). CORS
//! headers are sent for listed origins only.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use super::state::Shared;

pub async fn guard(State(state): State<Shared>, req: Request, next: Next) -> Response {
    let opts = &state.opts;
    // A declared body over the limit is refused before a byte of it is read when the client
    // waits for leave to send it (`Expect: 100-continue`) or the size is absurd (past 4x the
    // limit). A body only somewhat over is read up to the limit first (the body limit's 413):
    // answering before a client that is still writing has finished makes its kernel see a
    // reset, and most clients then report a broken connection instead of the 413.
    if let Some(len) = declared_length(req.headers()) {
        let limit = opts.max_body_bytes as u64;
        let expects = req
            .headers()
            .get(header::EXPECT)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
        if len > limit && (expects || len > limit.saturating_mul(4)) {
            return ApiError::payload_too_large(opts.max_body_bytes).into_response();
        }
    }
    // The body must arrive within --body-timeout (a trickling client holds nothing for long).
    let req = req.map(|body| axum::body::Body::new(Deadline::new(body, opts.body_timeout)));
    if is_loopback_bind(&opts.host) && !loopback_host(req.headers()) {
        return ApiError::forbidden(
            "This server is bound to loopback and answers loopback host names only \
             (localhost, 127.0.0.1, [::1])",
        )
        .into_response();
    }
    let origin = req
        .headers()
        .get(header::ORIGIN)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let Some(origin) = origin else {
        return next.run(req).await;
    };
    if !opts
        .allowed_origins
        .iter()
        .any(|o| o == &origin || o == "*")
    {
        return ApiError::forbidden(format!(
            "Requests from web pages are refused unless --allowed-origins lists their origin \
             (this one: {origin})"
        ))
        .into_response();
    }
    let preflight = req.method() == Method::OPTIONS;
    let mut resp = if preflight {
        StatusCode::NO_CONTENT.into_response()
    } else {
        next.run(req).await
    };
    let h = resp.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&origin) {
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, v);
    }
    h.insert(header::VARY, HeaderValue::from_static("Origin"));
    if preflight {
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST, OPTIONS"),
        );
        h.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static("authorization, content-type"),
        );
        h.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from_static("600"),
        );
    }
    resp
}

/// A body that fails with [`BodyTimedOut`] once its deadline passes.
struct Deadline {
    inner: axum::body::Body,
    sleep: Pin<Box<tokio::time::Sleep>>,
}

impl Deadline {
    fn new(inner: axum::body::Body, limit: Duration) -> Deadline {
        Deadline {
            inner,
            sleep: Box::pin(tokio::time::sleep(limit)),
        }
    }
}

/// The request body did not arrive within `--body-timeout`.
#[derive(Debug)]
pub struct BodyTimedOut;

impl std::fmt::Display for BodyTimedOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the request body did not arrive within --body-timeout")
    }
}

impl std::error::Error for BodyTimedOut {}

impl http_body::Body for Deadline {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        if self.sleep.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Some(Err(Box::new(BodyTimedOut))));
        }
        Pin::new(&mut self.inner).poll_frame(cx).map_err(Into::into)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Whether `e` (or what caused it) is a body that timed out.
pub fn timed_out(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if err.is::<BodyTimedOut>() {
            return true;
        }
        cur = err.source();
    }
    false
}

/// The body length a request declares.
fn declared_length(h: &HeaderMap) -> Option<u64> {
    h.get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Whether `--host` binds loopback only.
pub fn is_loopback_bind(host: &str) -> bool {
    host == "localhost"
        || host
            .trim_matches(|c| c == '[' || c == ']')
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The `Host` header names loopback (with or without a port); HTTP/1.1 requires one.
fn loopback_host(h: &HeaderMap) -> bool {
    let Some(host) = h.get(header::HOST).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let name = match host.strip_prefix('[') {
        // [::1]:8000
        Some(rest) => rest.split(']').next().unwrap_or_default(),
        None => host.rsplit_once(':').map_or(host, |(name, _)| name),
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::HOST, HeaderValue::from_str(v).expect("header"));
        h
    }

    #[test]
    fn loopback_names_pass_and_others_do_not() {
        for ok in [
            "localhost",
            "localhost:8000",
            "127.0.0.1:8000",
            "127.0.0.2",
            "[::1]:80",
            "LOCALHOST",
        ] {
            assert!(loopback_host(&host(ok)), "{ok}");
        }
        for bad in [
            "evil.example",
            "evil.example:8000",
            "10.0.0.1:8000",
            "localhost.evil.example",
            "[::2]:80",
        ] {
            assert!(!loopback_host(&host(bad)), "{bad}");
        }
        assert!(!loopback_host(&HeaderMap::new()));
    }

    #[test]
    fn binds_are_told_apart() {
        for lo in ["127.0.0.1", "localhost", "::1", "[::1]"] {
            assert!(is_loopback_bind(lo), "{lo}");
        }
        for wide in ["0.0.0.0", "::", "10.1.2.3"] {
            assert!(!is_loopback_bind(wide), "{wide}");
        }
    }
}
