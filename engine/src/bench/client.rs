//! One streamed request against an OpenAI-compatible server, timed the way SGLang's bench_serving
//! times it: TTFT at the first non-empty text chunk, inter-token gaps between text chunks, token
//! counts from the final `usage` (`stream_options.include_usage`).

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde::{Deserialize, Serialize};

use super::prompts::Prompt;

/// Which OpenAI route the bench drives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Endpoint {
    Chat,
    Completions,
}

/// Where and how to send requests.
#[derive(Clone, Debug)]
pub struct Target {
    /// Base URL, e.g. `http://127.0.0.1:8000` (no trailing `/v1`).
    pub url: String,
    pub model: String,
    pub api_key: Option<String>,
    pub endpoint: Endpoint,
    pub max_tokens: u32,
    pub ignore_eos: bool,
    /// Whole-request limit: a server that stalls costs at most this per request.
    pub request_timeout: Duration,
}

/// What one request measured. Times are seconds.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RequestRecord {
    pub ok: bool,
    pub error: Option<String>,
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    /// Send -> first non-empty text chunk.
    pub ttft: Option<f64>,
    /// Send -> end of stream.
    pub e2e: f64,
    /// Gaps between consecutive text chunks.
    #[serde(skip)]
    pub itl: Vec<f64>,
}

pub fn http_client(target: &Target) -> reqwest::Result<reqwest::Client> {
    reqwest::Client::builder()
        .timeout(target.request_timeout)
        .connect_timeout(Duration::from_secs(10))
        // A fresh connection per request: a server may close a kept-alive connection just as
        // the next request goes out on it (llama-server's HTTP library does, after a few
        // requests), which would count as a failed request. Connecting to a local server costs
        // far less than the timings measured, and the same for every server.
        .pool_max_idle_per_host(0)
        .build()
}

fn body(target: &Target, prompt: &Prompt) -> serde_json::Value {
    let mut b = serde_json::json!({
        "model": target.model,
        "max_tokens": target.max_tokens,
        "temperature": 0.0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if target.ignore_eos {
        b["ignore_eos"] = true.into();
    }
    match (target.endpoint, prompt) {
        (Endpoint::Chat, Prompt::Chat(m)) => b["messages"] = m.clone().into(),
        (Endpoint::Chat, Prompt::Text(t)) => {
            b["messages"] = serde_json::json!([{"role": "user", "content": t}])
        }
        (Endpoint::Completions, Prompt::Text(t)) => b["prompt"] = t.clone().into(),
        (Endpoint::Completions, Prompt::Chat(m)) => {
            let text: Vec<&str> = m.iter().filter_map(|x| x["content"].as_str()).collect();
            b["prompt"] = text.join("\n\n").into();
        }
    }
    b
}

/// Sends one request and streams the answer; never panics, errors land in the record.
pub async fn send(client: &reqwest::Client, target: &Target, prompt: &Prompt) -> RequestRecord {
    let start = Instant::now();
    let mut rec = RequestRecord::default();
    if let Err(e) = stream(client, target, prompt, start, &mut rec).await {
        rec.ok = false;
        rec.error = Some(e);
    }
    rec.e2e = start.elapsed().as_secs_f64();
    rec
}

async fn stream(
    client: &reqwest::Client,
    target: &Target,
    prompt: &Prompt,
    start: Instant,
    rec: &mut RequestRecord,
) -> Result<(), String> {
    let path = match target.endpoint {
        Endpoint::Chat => "/v1/chat/completions",
        Endpoint::Completions => "/v1/completions",
    };
    let mut req = client
        .post(format!("{}{path}", target.url.trim_end_matches('/')))
        .json(&body(target, prompt));
    if let Some(k) = &target.api_key {
        req = req.bearer_auth(k);
    }
    let resp = req.send().await.map_err(|e| classify(&e))?;
    let status = resp.status();
    if !status.is_success() {
        return Err(format!("HTTP {}", status.as_u16()));
    }
    let mut bytes = resp.bytes_stream();
    let mut pending = Vec::<u8>::new();
    let mut last_chunk: Option<Instant> = None;
    let mut text_chunks = 0u64;
    let mut done = false;
    while let Some(piece) = bytes.next().await {
        let piece = piece.map_err(|e| classify(&e))?;
        pending.extend_from_slice(&piece);
        while let Some(end) = pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line);
            let Some(data) = line.trim().strip_prefix("data:") else {
                continue;
            };
            let data = data.trim();
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let Ok(event) = serde_json::from_str::<serde_json::Value>(data) else {
                return Err("malformed SSE event".into());
            };
            if event.get("error").is_some() {
                return Err("error event in stream".into());
            }
            if let Some(u) = event.get("usage").filter(|u| !u.is_null()) {
                rec.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0);
                rec.output_tokens = u["completion_tokens"].as_u64().unwrap_or(0);
            }
            let choice = &event["choices"][0];
            let text = choice["delta"]["content"]
                .as_str()
                .or_else(|| choice["text"].as_str())
                .unwrap_or("");
            if !text.is_empty() {
                let now = Instant::now();
                match last_chunk {
                    None => rec.ttft = Some(now.duration_since(start).as_secs_f64()),
                    Some(t) => rec.itl.push(now.duration_since(t).as_secs_f64()),
                }
                last_chunk = Some(now);
                text_chunks += 1;
            }
        }
    }
    if !done {
        return Err("stream ended without [DONE]".into());
    }
    if rec.output_tokens == 0 {
        rec.output_tokens = text_chunks;
    }
    rec.ok = true;
    Ok(())
}

/// A short, stable error kind, so the report can count errors by kind.
fn classify(e: &reqwest::Error) -> String {
    if e.is_timeout() {
        "timeout".into()
    } else if e.is_connect() {
        "connection refused or failed".into()
    } else if e.is_body() || e.is_decode() {
        "response body broken".into()
    } else {
        // The innermost cause names what went wrong ("connection closed before message
        // completed": the server dropped a kept-alive connection), which a kind alone hides.
        let mut cause: &dyn std::error::Error = e;
        while let Some(inner) = cause.source() {
            cause = inner;
        }
        format!("request failed: {cause}")
    }
}

/// The server's first model id, from `/v1/models`.
pub async fn first_model(client: &reqwest::Client, target: &Target) -> Result<String, String> {
    let mut req = client.get(format!("{}/v1/models", target.url.trim_end_matches('/')));
    if let Some(k) = &target.api_key {
        req = req.bearer_auth(k);
    }
    let resp = req
        .send()
        .await
        .map_err(|e| format!("{}: {e}", target.url))?;
    if !resp.status().is_success() {
        return Err(format!("{}/v1/models: HTTP {}", target.url, resp.status()));
    }
    let v: serde_json::Value = resp
        .json()
        .await
        .map_err(|e| format!("{}/v1/models: {e}", target.url))?;
    v["data"][0]["id"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| format!("{}/v1/models lists no model", target.url))
}

/// Mean tokens per verified sequence so far, as (sum, count), from kiln's (or SGLang's) /metrics.
pub async fn accept_length_counters(client: &reqwest::Client, url: &str) -> Option<(f64, f64)> {
    let resp = client
        .get(format!("{}/metrics", url.trim_end_matches('/')))
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .ok()?;
    let text = resp.text().await.ok()?;
    let (mut sum, mut count) = (0.0, 0.0);
    let mut seen = false;
    for line in text.lines() {
        let value = || line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
        if line.starts_with("kiln_spec_accept_length_sum") {
            sum += value()?;
            seen = true;
        } else if line.starts_with("kiln_spec_accept_length_count") {
            count += value()?;
        }
    }
    seen.then_some((sum, count))
}
