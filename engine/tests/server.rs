//! The real `kiln serve` on the default model, driven over HTTP: the bad-input table, batched vs
//! single greedy outputs, a load of streaming clients that disconnect at random, SIGTERM draining,
//! and the official `openai` Python client plus a Prometheus parser (`tests/clients/`).

mod common;

use std::io::{BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::server::{Server, read_response, sse_data};
use serde_json::{Value, json};

const KEY: &str = "test-key-123";

fn auth() -> String {
    format!("Authorization: Bearer {KEY}")
}

/// (name, method, path, extra headers, body, expected status, expected `param` if any)
type Case = (
    &'static str,
    &'static str,
    &'static str,
    Vec<String>,
    Vec<u8>,
    u16,
    Option<&'static str>,
);

fn cases() -> Vec<Case> {
    let j = |v: Value| v.to_string().into_bytes();
    let chat = |extra: Value| {
        let mut v = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
        for (k, x) in extra.as_object().cloned().unwrap_or_default() {
            v[k] = x;
        }
        j(v)
    };
    let a = || vec![auth()];
    let c = "/v1/chat/completions";
    let p = "/v1/completions";
    vec![
        (
            "malformed JSON",
            "POST",
            c,
            a(),
            b"{\"messages\": [".to_vec(),
            400,
            None,
        ),
        (
            "not an object",
            "POST",
            c,
            a(),
            b"[1, 2]".to_vec(),
            400,
            None,
        ),
        ("empty body", "POST", c, a(), vec![], 400, None),
        (
            "invalid UTF-8",
            "POST",
            c,
            a(),
            b"{\"messages\": [{\"role\": \"user\", \"content\": \"\xff\xfe\"}]}".to_vec(),
            400,
            None,
        ),
        (
            "missing messages",
            "POST",
            c,
            a(),
            j(json!({"max_tokens": 3})),
            400,
            None,
        ),
        (
            "messages not a list",
            "POST",
            c,
            a(),
            j(json!({"messages": "hi"})),
            400,
            Some("messages"),
        ),
        (
            "empty messages",
            "POST",
            c,
            a(),
            j(json!({"messages": []})),
            400,
            Some("messages"),
        ),
        (
            "unknown role",
            "POST",
            c,
            a(),
            j(json!({"messages": [{"role": "wizard", "content": "hi"}]})),
            400,
            Some("messages[0].role"),
        ),
        (
            "content wrong type",
            "POST",
            c,
            a(),
            j(json!({"messages": [{"role": "user", "content": 5}]})),
            400,
            Some("messages[0].content"),
        ),
        (
            "image content part",
            "POST",
            c,
            a(),
            j(json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})),
            400,
            Some("messages[0].content[0]"),
        ),
        (
            "missing user content",
            "POST",
            c,
            a(),
            j(json!({"messages": [{"role": "user"}]})),
            400,
            Some("messages[0].content"),
        ),
        (
            "unknown model",
            "POST",
            c,
            a(),
            chat(json!({"model": "gpt-9"})),
            404,
            Some("model"),
        ),
        (
            "negative max_tokens",
            "POST",
            c,
            a(),
            chat(json!({"max_tokens": -5})),
            400,
            Some("max_tokens"),
        ),
        (
            "zero max_tokens",
            "POST",
            c,
            a(),
            chat(json!({"max_tokens": 0})),
            400,
            Some("max_tokens"),
        ),
        (
            "huge max_tokens",
            "POST",
            c,
            a(),
            chat(json!({"max_tokens": 10_000_000})),
            400,
            Some("max_tokens"),
        ),
        (
            "max_tokens a string",
            "POST",
            c,
            a(),
            chat(json!({"max_tokens": "ten"})),
            400,
            Some("max_tokens"),
        ),
        (
            "temperature too high",
            "POST",
            c,
            a(),
            chat(json!({"temperature": 7})),
            400,
            Some("temperature"),
        ),
        (
            "negative temperature",
            "POST",
            c,
            a(),
            chat(json!({"temperature": -1})),
            400,
            Some("temperature"),
        ),
        (
            "temperature a string",
            "POST",
            c,
            a(),
            chat(json!({"temperature": "hot"})),
            400,
            Some("temperature"),
        ),
        (
            "top_p zero",
            "POST",
            c,
            a(),
            chat(json!({"top_p": 0})),
            400,
            Some("top_p"),
        ),
        (
            "top_p above one",
            "POST",
            c,
            a(),
            chat(json!({"top_p": 1.5})),
            400,
            Some("top_p"),
        ),
        (
            "top_k negative",
            "POST",
            c,
            a(),
            chat(json!({"top_k": -3})),
            400,
            Some("top_k"),
        ),
        (
            "min_p above one",
            "POST",
            c,
            a(),
            chat(json!({"min_p": 2})),
            400,
            Some("min_p"),
        ),
        (
            "presence penalty out of range",
            "POST",
            c,
            a(),
            chat(json!({"presence_penalty": 3})),
            400,
            Some("presence_penalty"),
        ),
        (
            "frequency penalty out of range",
            "POST",
            c,
            a(),
            chat(json!({"frequency_penalty": -9})),
            400,
            Some("frequency_penalty"),
        ),
        (
            "negative seed",
            "POST",
            c,
            a(),
            chat(json!({"seed": -1})),
            400,
            Some("seed"),
        ),
        (
            "n zero",
            "POST",
            c,
            a(),
            chat(json!({"n": 0})),
            400,
            Some("n"),
        ),
        (
            "n too large",
            "POST",
            c,
            a(),
            chat(json!({"n": 1000})),
            400,
            Some("n"),
        ),
        (
            "empty stop string",
            "POST",
            c,
            a(),
            chat(json!({"stop": [""]})),
            400,
            Some("stop"),
        ),
        (
            "stop token outside vocab",
            "POST",
            c,
            a(),
            chat(json!({"stop_token_ids": [999999]})),
            400,
            Some("stop_token_ids"),
        ),
        (
            "top_logprobs without logprobs",
            "POST",
            c,
            a(),
            chat(json!({"top_logprobs": 3})),
            400,
            Some("top_logprobs"),
        ),
        (
            "top_logprobs too many",
            "POST",
            c,
            a(),
            chat(json!({"logprobs": true, "top_logprobs": 50})),
            400,
            Some("top_logprobs"),
        ),
        (
            "stream_options without stream",
            "POST",
            c,
            a(),
            chat(json!({"stream_options": {"include_usage": true}})),
            400,
            Some("stream_options"),
        ),
        (
            "unknown field",
            "POST",
            c,
            a(),
            chat(json!({"temprature": 1})),
            400,
            Some("temprature"),
        ),
        (
            "trailing bytes after the JSON body",
            "POST",
            c,
            a(),
            [chat(json!({})), b" {\"max_tokens\": 9999}".to_vec()].concat(),
            400,
            None,
        ),
        (
            "a 1 MB unknown field name (the error stays small)",
            "POST",
            c,
            a(),
            {
                let mut v = json!({"messages": [{"role": "user", "content": "hi"}]});
                v["x".repeat(1 << 20)] = json!(1);
                j(v)
            },
            400,
            None,
        ),
        (
            "16 prompts x n 16 in one request",
            "POST",
            p,
            a(),
            j(json!({"prompt": vec!["hi"; 16], "n": 16, "max_tokens": 1})),
            400,
            Some("n"),
        ),
        (
            "prompt too long for the context",
            "POST",
            p,
            a(),
            j(json!({"prompt": "word ".repeat(9000), "max_tokens": 1})),
            400,
            Some("prompt"),
        ),
        (
            "prompt token outside vocab",
            "POST",
            p,
            a(),
            j(json!({"prompt": [1, 2, 99999999]})),
            400,
            Some("prompt"),
        ),
        (
            "prompt wrong type",
            "POST",
            p,
            a(),
            j(json!({"prompt": {"text": "x"}})),
            400,
            Some("prompt"),
        ),
        (
            "missing prompt",
            "POST",
            p,
            a(),
            j(json!({"max_tokens": 2})),
            400,
            None,
        ),
        (
            "empty token prompt",
            "POST",
            p,
            a(),
            j(json!({"prompt": []})),
            400,
            Some("prompt"),
        ),
        (
            "logprobs too many",
            "POST",
            p,
            a(),
            j(json!({"prompt": "x", "logprobs": 99})),
            400,
            Some("logprobs"),
        ),
        (
            "echo unsupported",
            "POST",
            p,
            a(),
            j(json!({"prompt": "x", "echo": true})),
            400,
            Some("echo"),
        ),
        (
            "oversize body",
            "POST",
            c,
            a(),
            vec![b' '; 5 << 20],
            413,
            None,
        ),
        (
            "missing auth",
            "POST",
            c,
            vec![],
            chat(json!({})),
            401,
            None,
        ),
        (
            "wrong auth",
            "POST",
            c,
            vec!["Authorization: Bearer nope".into()],
            chat(json!({})),
            401,
            None,
        ),
        (
            "auth without Bearer",
            "POST",
            c,
            vec![format!("Authorization: {KEY}")],
            chat(json!({})),
            401,
            None,
        ),
        (
            "unknown route",
            "GET",
            "/v2/whatever",
            a(),
            vec![],
            404,
            None,
        ),
        (
            "wrong method on completions",
            "GET",
            p,
            a(),
            vec![],
            405,
            None,
        ),
        (
            "wrong method on models",
            "DELETE",
            "/v1/models",
            a(),
            vec![],
            405,
            None,
        ),
        (
            "tokenize with both inputs",
            "POST",
            "/tokenize",
            a(),
            j(json!({"prompt": "a", "messages": []})),
            400,
            None,
        ),
        (
            "detokenize outside vocab",
            "POST",
            "/detokenize",
            a(),
            j(json!({"tokens": [4000000]})),
            400,
            Some("tokens"),
        ),
    ]
}

#[test]
fn bad_input_gets_openai_errors_and_the_server_keeps_serving() {
    let s = Server::start(&["--api-key", KEY, "--max-body-bytes", "4194304"]);
    let table = cases();
    assert!(table.len() >= 30);
    let good = json!({"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 0});
    for (name, method, path, headers, body, want, param) in table {
        let h: Vec<&str> = headers.iter().map(String::as_str).collect();
        let (status, text) = s.request(method, path, &h, &body);
        assert_eq!(status, want, "{name}: {text}");
        assert!(
            text.len() < 4096,
            "{name}: a {} byte error body",
            text.len()
        );
        let v: Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name}: {e}: {text}"));
        let err = &v["error"];
        assert!(
            err["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{name}: {text}"
        );
        assert!(err["type"].is_string(), "{name}: {text}");
        assert!(
            err.get("param").is_some() && err.get("code").is_some(),
            "{name}: {text}"
        );
        if let Some(p) = param {
            assert_eq!(err["param"], p, "{name}: {text}");
        }
        // The server answers a good request between any two bad ones.
        let a = auth();
        let (ok, body) = s.request(
            "POST",
            "/v1/chat/completions",
            &[&a],
            good.to_string().as_bytes(),
        );
        assert_eq!(ok, 200, "after {name}: {body}");
    }
    // Open routes stay open.
    assert_eq!(s.request("GET", "/health", &[], b"").0, 200);
    assert_eq!(s.request("GET", "/metrics", &[], b"").0, 200);
}

fn greedy(s: &Server, prompt: &str) -> String {
    let (st, v) = s.post_json(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(st, 200, "{v}");
    v["choices"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

#[test]
fn batched_greedy_equals_single_and_load_with_disconnects_frees_every_block() {
    let s = Server::start(&["--mode", "exact"]);
    let prompts: Vec<String> = [
        "def is_prime(n):",
        "The capital of France is",
        "1, 2, 3, 4,",
        "Once upon a time",
        "import numpy as np\n",
        "The water boils at",
        "SELECT * FROM",
        "Dear Sir or Madam,",
    ]
    .iter()
    .map(|p| p.to_string())
    .collect();
    let alone: Vec<String> = prompts.iter().map(|p| greedy(&s, p)).collect();
    let together: Vec<String> = std::thread::scope(|sc| {
        let hs: Vec<_> = prompts.iter().map(|p| sc.spawn(|| greedy(&s, p))).collect();
        hs.into_iter().map(|h| h.join().expect("client")).collect()
    });
    assert_eq!(alone, together, "batched greedy output differs from single");
    assert!(s.metric("kiln_batch_size_sum") > 0.0);

    // 256 streaming clients (the whole default queue); every third hangs up after a few events.
    let port = s.port;
    let results: Vec<Option<usize>> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..256)
            .map(|i| {
                sc.spawn(move || {
                    let body = json!({"messages": [{"role": "user", "content": format!("Count to {i}")}],
                        "max_tokens": 4 + i % 8, "stream": true, "temperature": 0.7, "seed": i,
                        "stream_options": {"include_usage": true}})
                    .to_string();
                    let mut t = TcpStream::connect(("127.0.0.1", port)).expect("connect");
                    t.set_read_timeout(Some(Duration::from_secs(300))).expect("timeout");
                    let req = format!(
                        "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    t.write_all(req.as_bytes()).expect("send");
                    if i % 3 == 0 {
                        let mut buf = vec![0; 200 + 37 * (i % 7)];
                        let _ = t.read(&mut buf);
                        return None; // drop: disconnect mid-stream
                    }
                    let (status, body) = read_response(BufReader::new(t)).expect("response");
                    assert_eq!(status, 200, "{body}");
                    let data = sse_data(&body);
                    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{body}");
                    let chunks: Vec<Value> = data[..data.len() - 1]
                        .iter()
                        .map(|d| serde_json::from_str(d).expect("chunk JSON"))
                        .collect();
                    let usage = &chunks.last().expect("usage chunk")["usage"];
                    let finish = chunks.iter().filter(|c| !c["choices"][0]["finish_reason"].is_null()).count();
                    assert_eq!(finish, 1, "{body}");
                    Some(usage["completion_tokens"].as_u64().unwrap_or(0) as usize)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("client")).collect()
    });
    assert!(results.iter().flatten().all(|&n| n >= 1));
    // Aborted sequences are dropped at the engine's next step.
    let mut used = f64::NAN;
    for _ in 0..100 {
        used = s.metric("kiln_kv_blocks_used");
        if used == 0.0 && s.metric("kiln_running_requests") == 0.0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(used, 0.0, "KV blocks still in use after the load");
    assert_eq!(s.request("GET", "/health", &[], b"").0, 200);
}

#[test]
fn sigterm_finishes_in_flight_requests_refuses_new_ones_and_exits_zero() {
    let mut s = Server::start(&[]);
    let port = s.port;
    let inflight = std::thread::spawn(move || {
        let mut t = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        let body = json!({"prompt": "Once upon a time", "max_tokens": 150, "ignore_eos": true, "temperature": 0}).to_string();
        let req = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        t.write_all(req.as_bytes()).expect("send");
        read_response(BufReader::new(t)).expect("response")
    });
    std::thread::sleep(Duration::from_millis(600));
    // The request is in the engine when the signal arrives (150 tokens take seconds here).
    assert_eq!(
        s.metric("kiln_running_requests"),
        1.0,
        "no request was in flight at the signal"
    );
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &s.child.id().to_string()])
        .status();
    std::thread::sleep(Duration::from_millis(200));
    // The listener stays up while draining: /ready and new requests are answered 503, with
    // Retry-After.
    assert_eq!(s.request("GET", "/ready", &[], b"").0, 503);
    let mut t = TcpStream::connect(("127.0.0.1", port)).expect("connect while draining");
    let body = json!({"prompt": "hi", "max_tokens": 2}).to_string();
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    t.write_all(req.as_bytes()).expect("send");
    let mut raw = String::new();
    std::io::Read::read_to_string(&mut t, &mut raw).expect("read");
    assert!(raw.starts_with("HTTP/1.1 503"), "{raw}");
    assert!(raw.to_ascii_lowercase().contains("retry-after: 5"), "{raw}");
    assert!(raw.contains("shutting down"), "{raw}");
    let (status, body) = inflight.join().expect("in-flight client");
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).expect("json");
    assert_eq!(v["usage"]["completion_tokens"], 150, "{body}");
    let code = s.child.wait().expect("wait");
    assert!(code.success(), "exit status {code}");
}

#[test]
fn official_openai_client_and_prometheus_parser() {
    let s = Server::start(&["--api-key", KEY]);
    s.run_client("openai_client.py", &[KEY]);
    // And curl, the other client every operator uses.
    let curl = std::process::Command::new("curl")
        .args(["-sS", "-H", &format!("Authorization: Bearer {KEY}"), "-d"])
        .arg(r#"{"prompt":"Hello","max_tokens":3}"#)
        .arg(format!("{}/v1/completions", s.base_url()))
        .output()
        .expect("curl");
    let v: Value = serde_json::from_slice(&curl.stdout).expect("curl JSON");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["usage"]["completion_tokens"], 3);
}

#[test]
fn a_request_that_can_never_fit_the_queue_is_a_400_not_a_retryable_429() {
    let s = Server::start(&["--max-queue", "2", "--max-n", "4"]);
    let (status, v) = s.post_json(
        "/v1/completions",
        &json!({"prompt": "hi", "n": 3, "max_tokens": 1}),
    );
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "n", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("never fit")),
        "{v}"
    );
    let (status, v) = s.post_json(
        "/v1/completions",
        &json!({"prompt": "hi", "n": 2, "max_tokens": 1}),
    );
    assert_eq!(status, 200, "{v}");
}

#[test]
fn sighup_is_ignored_and_the_shutdown_timeout_ends_a_stream_with_an_error_and_done() {
    let mut s = Server::start(&["--shutdown-timeout", "1"]);
    let _ = std::process::Command::new("kill")
        .args(["-HUP", &s.child.id().to_string()])
        .status();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        s.request("GET", "/ready", &[], b"").0,
        200,
        "SIGHUP killed or drained the server"
    );
    let port = s.port;
    let stream = std::thread::spawn(move || {
        let mut t = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        let body = json!({"prompt": "Once upon a time", "max_tokens": 6000, "ignore_eos": true,
                          "stream": true})
        .to_string();
        let req = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        t.write_all(req.as_bytes()).expect("send");
        read_response(BufReader::new(t)).expect("response")
    });
    std::thread::sleep(Duration::from_millis(800));
    let code = s.terminate();
    let (status, body) = stream.join().expect("stream client");
    assert_eq!(status, 200, "{body}");
    let events: Vec<&str> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert!(events.len() > 3, "the stream ran before the cut: {body}");
    assert_eq!(events.last(), Some(&"[DONE]"), "{body}");
    let error = events[events.len() - 2];
    assert!(
        error.contains("shutting down"),
        "no error event before [DONE]: {error}"
    );
    assert!(code.success(), "exit status {code}");
}

/// A raw HTTP/1.1 exchange: `head` (request line and headers, without the blank line), then
/// `body`; the whole answer as text, read until the server closes or 5 s pass.
fn raw(port: u16, head: &str, body: &[u8]) -> String {
    let mut t = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    t.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    t.write_all(format!("{head}\r\n\r\n").as_bytes())
        .expect("send head");
    if !body.is_empty() {
        t.write_all(body).expect("send body");
    }
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match std::io::Read::read(&mut t, &mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&out).to_string()
}

#[test]
fn web_pages_rebinding_hosts_and_huge_declared_bodies_are_refused_at_the_door() {
    let s = Server::start(&["--allowed-origins", "https://app.example"]);
    let body = json!({"prompt": "hi", "max_tokens": 1}).to_string();
    let post = |extra: &str| {
        format!(
            "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
             Content-Type: text/plain\r\nContent-Length: {}{extra}",
            body.len()
        )
    };
    // A cross-site page (the browser adds its Origin): refused.
    let r = raw(
        s.port,
        &post("\r\nOrigin: https://evil.example"),
        body.as_bytes(),
    );
    assert!(r.starts_with("HTTP/1.1 403"), "{r}");
    assert!(r.contains("--allowed-origins"), "{r}");
    // A listed origin: served, with CORS headers; its preflight answered.
    let r = raw(
        s.port,
        &post("\r\nOrigin: https://app.example"),
        body.as_bytes(),
    );
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    assert!(
        r.to_ascii_lowercase()
            .contains("access-control-allow-origin: https://app.example"),
        "{r}"
    );
    let r = raw(
        s.port,
        "OPTIONS /v1/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
         Origin: https://app.example\r\nAccess-Control-Request-Method: POST",
        b"",
    );
    assert!(r.starts_with("HTTP/1.1 204"), "{r}");
    assert!(
        r.to_ascii_lowercase()
            .contains("access-control-allow-headers"),
        "{r}"
    );
    // DNS rebinding: a page's own host name pointed at 127.0.0.1.
    let r = raw(
        s.port,
        &format!(
            "POST /v1/completions HTTP/1.1\r\nHost: evil.example:{}\r\nConnection: close\r\n\
             Content-Length: {}",
            s.port,
            body.len()
        ),
        body.as_bytes(),
    );
    assert!(r.starts_with("HTTP/1.1 403"), "{r}");
    // A declared length past the limit is answered at once, before any body, and an
    // `Expect: 100-continue` client is not invited to send it.
    let r = raw(
        s.port,
        "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
         Content-Length: 99999999999",
        b"",
    );
    assert!(r.starts_with("HTTP/1.1 413"), "{r}");
    let r = raw(
        s.port,
        "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
         Expect: 100-continue\r\nContent-Length: 52428800",
        b"",
    );
    assert!(r.starts_with("HTTP/1.1 413"), "{r}");
    assert!(!r.contains("100 Continue"), "{r}");
    // Plain clients (no Origin, a loopback Host) are served as before.
    assert_eq!(
        s.post_json("/v1/completions", &json!({"prompt": "hi", "max_tokens": 1}))
            .0,
        200
    );
}

#[test]
fn silent_and_trickling_clients_are_let_go_and_health_is_still_answered() {
    let s = Server::start(&[
        "--header-timeout",
        "1",
        "--body-timeout",
        "1",
        "--max-connections",
        "4",
    ]);
    // More silent sockets than the server holds connections.
    let silent: Vec<TcpStream> = (0..6)
        .map(|_| TcpStream::connect(("127.0.0.1", s.port)).expect("connect"))
        .collect();
    let t0 = std::time::Instant::now();
    let (status, _) = s.request("GET", "/health", &[], b"");
    assert_eq!(status, 200);
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "/health waited {:?} behind silent sockets",
        t0.elapsed()
    );
    for mut sock in silent {
        sock.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let mut buf = [0u8; 64];
        match std::io::Read::read(&mut sock, &mut buf) {
            Ok(_) => {}
            Err(e) => panic!("a silent socket was held open past the header timeout: {e}"),
        }
    }
    // A body that trickles in slower than --body-timeout gets 408.
    let mut t = TcpStream::connect(("127.0.0.1", s.port)).expect("connect");
    t.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
          Content-Length: 100\r\n\r\n{\"prompt\": ",
    )
    .expect("send");
    t.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let (status, body) = read_response(BufReader::new(t)).expect("response");
    assert_eq!(status, 408, "{body}");
}

/// Resident and peak resident memory of a process, in MiB (Linux).
fn rss_mib(pid: u32) -> (f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let field = |name: &str| -> f64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<f64>().ok())
            .map_or(f64::NAN, |kib| kib / 1024.0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Sixteen concurrent 4 MB chat bodies (each far past the context): all refused with 400, the
/// work done off the async workers and a few at a time, so memory stays bounded and /health
/// keeps answering; its latency during the attack is printed (measured, not asserted).
#[test]
fn a_burst_of_huge_prompts_is_refused_without_exhausting_memory() {
    let s = Server::start(&["--max-body-bytes", "4194304"]);
    let pid = s.child.id();
    // Reset the peak to now, so it measures the burst and not the model's loading.
    let _ = std::fs::write(format!("/proc/{pid}/clear_refs"), "5");
    let (before, _) = rss_mib(pid);
    let content = "lorem ipsum ".repeat(4_000_000 / 12);
    let body =
        json!({"messages": [{"role": "user", "content": content}], "max_tokens": 4}).to_string();
    let port = s.port;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let probe = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut worst = Duration::ZERO;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let t0 = std::time::Instant::now();
                let r = raw(
                    port,
                    "GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close",
                    b"",
                );
                worst = worst.max(t0.elapsed());
                assert!(
                    r.starts_with("HTTP/1.1 200"),
                    "/health failed during the burst: {r}"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            worst
        })
    };
    let clients: Vec<_> = (0..16)
        .map(|_| {
            let body = body.clone();
            std::thread::spawn(move || {
                let mut t = TcpStream::connect(("127.0.0.1", port)).expect("connect");
                let head = format!(
                    "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
                     Content-Length: {}\r\n\r\n",
                    body.len()
                );
                t.write_all(head.as_bytes()).expect("head");
                t.write_all(body.as_bytes()).expect("body");
                read_response(BufReader::new(t)).expect("response")
            })
        })
        .collect();
    for c in clients {
        let (status, text) = c.join().expect("client");
        assert_eq!(status, 400, "{}", &text[..text.len().min(300)]);
        assert!(
            text.contains("context_length_exceeded"),
            "{}",
            &text[..text.len().min(300)]
        );
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let worst = probe.join().expect("probe");
    let (_, peak) = rss_mib(pid);
    eprintln!(
        "burst of 16 x 4 MB chat bodies: /health worst {:.0} ms; resident {before:.0} MiB before, \
         peak {peak:.0} MiB",
        worst.as_secs_f64() * 1e3
    );
    // The bodies themselves are 64 MB; before the work moved off the async workers and gained
    // its early length check, the peak grew by over 1 GB.
    assert!(
        peak - before < 320.0,
        "peak memory grew {:.0} MiB under the burst",
        peak - before
    );
    assert_eq!(
        s.post_json("/v1/completions", &json!({"prompt": "hi", "max_tokens": 1}))
            .0,
        200
    );
}

/// Three hundred silent sockets against a server limited to 256 file descriptors: its
/// connection cap stays under the limit, so the sockets wait in the listen queue rather than
/// exhausting descriptors, each is closed within the header timeout once accepted, and
/// `/health` is answered (its wait is printed).
#[test]
fn three_hundred_silent_sockets_under_256_descriptors_do_not_lock_the_server_out() {
    let port = common::server::free_port();
    let model = common::smollm2();
    let cmd = format!(
        "ulimit -n 256 && exec '{}' serve --port {port} --model '{}' --kv-tokens 8192 \
         --threads 1 --header-timeout 2",
        env!("CARGO_BIN_EXE_kiln"),
        model.display()
    );
    let child = std::process::Command::new("sh")
        .args(["-c", &cmd])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("spawn");
    let s = Server { child, port };
    let t0 = std::time::Instant::now();
    while s.try_request("GET", "/ready", &[], b"").map(|r| r.0).ok() != Some(200) {
        assert!(t0.elapsed() < Duration::from_secs(120), "server not ready");
        std::thread::sleep(Duration::from_millis(100));
    }
    let silent: Vec<TcpStream> = (0..300)
        .filter_map(|_| TcpStream::connect(("127.0.0.1", port)).ok())
        .collect();
    assert!(
        silent.len() >= 250,
        "only {} sockets connected",
        silent.len()
    );
    let t0 = std::time::Instant::now();
    let (status, _) = s.request("GET", "/health", &[], b"");
    let waited = t0.elapsed();
    assert_eq!(status, 200);
    eprintln!(
        "{} silent sockets, 256 descriptors: /health answered after {:.0} ms",
        silent.len(),
        waited.as_secs_f64() * 1e3
    );
    assert!(
        waited < Duration::from_secs(30),
        "/health waited {waited:?}"
    );
    // Every silent socket is let go (read returns: closed by the server).
    for mut sock in silent {
        sock.set_read_timeout(Some(Duration::from_secs(20)))
            .expect("timeout");
        let mut buf = [0u8; 16];
        assert!(
            std::io::Read::read(&mut sock, &mut buf).is_ok(),
            "a silent socket was never closed"
        );
    }
    assert_eq!(s.request("GET", "/health", &[], b"").0, 200);
}
