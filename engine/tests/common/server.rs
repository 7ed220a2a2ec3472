//! Starts the real `kiln serve` binary on a free port and talks plain HTTP/1.1 to it.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Server {
    pub child: Child,
    pub port: u16,
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

impl Server {
    /// `kiln serve` on the default model with `extra` flags; returns once /ready answers 200.
    pub fn start(extra: &[&str]) -> Server {
        let port = free_port();
        let model = super::smollm2();
        let model = model.to_string_lossy();
        let port_text = port.to_string();
        let mut args = vec!["--port", &port_text, "--model", &model];
        args.extend_from_slice(&["--kv-tokens", "8192", "--threads", "1"]);
        args.extend_from_slice(extra);
        Server::start_exactly(port, &args)
    }

    /// `kiln serve ARGS`, nothing added, listening on `port` (given in ARGS or in the config or
    /// lock they name); returns once /ready answers 200.
    pub fn start_exactly(port: u16, args: &[&str]) -> Server {
        Server::start_with_env(port, args, &[])
    }

    /// `start_exactly` with `env` set for the server process.
    pub fn start_with_env(port: u16, args: &[&str], env: &[(&str, &str)]) -> Server {
        let child = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .envs(env.iter().copied())
            .arg("serve")
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn kiln serve");
        let mut s = Server { child, port };
        let t0 = Instant::now();
        loop {
            if let Ok((200, _)) = s.try_request("GET", "/ready", &[], b"") {
                return s;
            }
            if let Ok(Some(status)) = s.child.try_wait() {
                panic!("kiln serve {args:?} exited before it was ready ({status})");
            }
            assert!(t0.elapsed() < Duration::from_secs(120), "server not ready");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Runs a client script from `tests/clients/` against this server with `args` after its
    /// base URL; the script must succeed and print `ALL CHECKS PASSED`.
    #[allow(dead_code)]
    pub fn run_client(&self, script: &str, args: &[&str]) {
        let script = format!("{}/tests/clients/{script}", env!("CARGO_MANIFEST_DIR"));
        let python = std::env::var("KILN_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
        let out = std::process::Command::new(&python)
            .arg(&script)
            .arg(self.base_url())
            .args(args)
            .output()
            .unwrap_or_else(|e| {
                panic!("{python}: {e} (install: python3 -m pip install openai prometheus-client)")
            });
        let log = format!(
            "{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{script} failed:\n{log}");
        assert!(log.contains("ALL CHECKS PASSED"), "{log}");
    }

    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[&str],
        body: &[u8],
    ) -> (u16, String) {
        self.try_request(method, path, headers, body)
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
    }

    pub fn try_request(
        &self,
        method: &str,
        path: &str,
        headers: &[&str],
        body: &[u8],
    ) -> std::io::Result<(u16, String)> {
        Server::request_on(self.port, method, path, headers, body)
    }

    /// `try_request` to the server on `port`, without holding it (from another thread).
    pub fn request_on(
        port: u16,
        method: &str,
        path: &str,
        headers: &[&str],
        body: &[u8],
    ) -> std::io::Result<(u16, String)> {
        let mut s = TcpStream::connect(("127.0.0.1", port))?;
        s.set_read_timeout(Some(Duration::from_secs(300)))?;
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: {}\r\n",
            body.len()
        );
        for h in headers {
            head.push_str(h);
            head.push_str("\r\n");
        }
        head.push_str("\r\n");
        s.write_all(head.as_bytes())?;
        if let Err(e) = s.write_all(body) {
            // A server may answer and close before a large body is all sent (an early 413), as
            // kiln does past 4x its limit: read what it said, as curl does.
            use std::io::ErrorKind::{BrokenPipe, ConnectionReset};
            if !matches!(e.kind(), BrokenPipe | ConnectionReset) {
                return Err(e);
            }
        }
        read_response(BufReader::new(s))
    }

    pub fn post_json(&self, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
        let (status, text) = self.request("POST", path, &[], body.to_string().as_bytes());
        let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}: {text}"));
        (status, v)
    }

    pub fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.request("GET", "/metrics", &[], b"");
        text.lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("metric {name} missing"))
    }

    /// SIGTERM, then the exit status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        self.child.wait().expect("wait")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Status and body; chunked bodies (SSE) are de-chunked.
pub fn read_response(mut r: impl BufRead) -> std::io::Result<(u16, String)> {
    let mut line = String::new();
    r.read_line(&mut line)?;
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad status line {line:?}")))?;
    let mut chunked = false;
    loop {
        line.clear();
        r.read_line(&mut line)?;
        if line == "\r\n" || line.is_empty() {
            break;
        }
        let l = line.to_ascii_lowercase();
        if l.starts_with("transfer-encoding:") && l.contains("chunked") {
            chunked = true;
        }
    }
    let mut body = Vec::new();
    if chunked {
        loop {
            line.clear();
            r.read_line(&mut line)?;
            let n = usize::from_str_radix(line.trim(), 16).unwrap_or(0);
            if n == 0 {
                break;
            }
            let mut chunk = vec![0; n + 2];
            r.read_exact(&mut chunk)?;
            body.extend_from_slice(&chunk[..n]);
        }
    } else {
        r.read_to_end(&mut body)?;
    }
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// The `data:` payloads of an SSE body.
pub fn sse_data(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(String::from)
        .collect()
}
