//! The production tooling end to end on the default model: `kiln bench sweep` starts the real
//! server per config, `kiln lock create` freezes one, `kiln doc` writes production.md from it,
//! `kiln doctor --lock` finds drift, `kiln serve --lock` runs it (refusing conflicting flags, with
//! the canary and drift in /ready and /metrics); and the bench against broken servers.

mod common;

use std::time::{Duration, Instant};

use common::cli::{kiln, ok, s, tempdir};
use common::server::{Server, free_port};
use kiln::lock::Lock;

#[test]
fn sweep_lock_doc_doctor_and_serve_lock() {
    let dir = tempdir("production");
    let model = common::smollm2();
    let port = free_port();
    let configs = dir.join("configs.toml");
    std::fs::write(
        &configs,
        format!(
            "[bench]\nconcurrency = [1, 2]\nnum-prompts = 3\nmax-tokens = 8\n\n\
             [serve]\nmodel = {:?}\nport = {port}\nkv-tokens = 4096\nthreads = 1\n\n\
             [[config]]\nname = \"baseline\"\n\n\
             [[config]]\nname = \"ngram\"\nspeculative-algorithm = \"ngram\"\nspeculative-policy = \"fixed\"\n",
            s(&model)
        ),
    )
    .expect("write configs");
    let stem = dir.join("sweep");
    let out = ok(
        &kiln(&["bench", "sweep", &s(&configs), "--out", &s(&stem)]),
        "bench sweep",
    );
    assert!(out.contains("### comparison"), "{out}");
    let png = std::fs::read(dir.join("sweep.png")).expect("png");
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    let svg = std::fs::read_to_string(dir.join("sweep.svg")).expect("svg");
    assert!(svg.contains("<svg") && svg.contains("baseline") && svg.contains("ngram"));
    let sweep = kiln::lock::Sweep::read(&dir.join("sweep.json")).expect("sweep json");
    assert_eq!(sweep.configs.len(), 2);
    for c in &sweep.configs {
        assert_eq!(c.result.levels.len(), 2);
        for l in &c.result.levels {
            assert_eq!((l.completed, l.failed), (3, 0), "{}: {l:?}", c.name);
            assert!(l.output_tok_s > 0.0 && l.ttft_ms.p50 > 0.0);
            assert!(
                (l.mean_output_tokens - 8.0).abs() < 1e-9,
                "ignore_eos: 8 tokens each"
            );
        }
    }
    assert!(sweep.configs[1].result.levels[0].accept_length.is_some());
    let compared = ok(
        &kiln(&["bench", "compare", &s(&dir.join("sweep.json"))]),
        "bench compare",
    );
    assert!(compared.contains("| 1 | ngram |"), "{compared}");

    let lock_path = dir.join("kiln.lock");
    ok(
        &kiln(&[
            "lock",
            "create",
            "--from",
            &s(&dir.join("sweep.json")),
            "--choose",
            "baseline",
            "-o",
            &s(&lock_path),
        ]),
        "lock create",
    );
    let lock = Lock::read(&lock_path).expect("lock");
    assert_eq!(lock.model.sha256, kiln::catalog::DEFAULT_MODEL.sha256);
    assert_eq!(lock.serve["speculative-algorithm"].as_str(), Some("none"));
    assert_eq!(lock.serve["port"].as_integer(), Some(i64::from(port)));
    assert_eq!(lock.evidence.len(), 2);
    assert_eq!(lock.rejected.len(), 1);
    assert!(!lock.serve.contains_key("api-key"));

    // The document holds every section and every number of the lock.
    let doc_path = dir.join("production.md");
    ok(&kiln(&["doc", &s(&lock_path), "-o", &s(&doc_path)]), "doc");
    let doc = std::fs::read_to_string(&doc_path).expect("doc");
    for section in [
        "## Rationale",
        "## Hardware",
        "## Software stack",
        "## Settings",
        "## Launch",
        "## Environment and NCCL tuning",
        "## Applied patches",
        "## Model files",
        "## Benchmark evidence",
        "## Rejected alternatives",
        "## Runbook",
        "Upgrade checklist",
        "Rollback",
        "kiln serve --lock",
        "kiln systemd-unit --lock",
    ] {
        assert!(doc.contains(section), "missing {section}");
    }
    let mut numbers = vec![
        lock.model.sha256.clone(),
        lock.model.bytes.to_string(),
        lock.fingerprint.git_rev.clone(),
        lock.fingerprint.kernel.clone(),
        lock.fingerprint.cpu.clone(),
        lock.lock.rationale.clone(),
        lock.rejected[0].reason.clone(),
    ];
    for (k, v) in &lock.serve {
        let v = v
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| v.to_string());
        numbers.push(format!("| `{k}` | `{v}` |"));
    }
    for e in &lock.evidence {
        for l in &e.levels {
            numbers.extend([
                format!("{:.1}", l.output_tok_s),
                format!("{:.1}", l.input_tok_s),
                format!("{:.3}", l.request_throughput),
                format!(
                    "{:.0} / {:.0} / {:.0}",
                    l.ttft_ms.mean, l.ttft_ms.p50, l.ttft_ms.p99
                ),
                format!(
                    "{:.1} / {:.1} / {:.1}",
                    l.tpot_ms.mean, l.tpot_ms.p50, l.tpot_ms.p99
                ),
                format!(
                    "{:.1} / {:.1} / {:.1}",
                    l.itl_ms.mean, l.itl_ms.p50, l.itl_ms.p99
                ),
                format!(
                    "{:.0} / {:.0} / {:.0}",
                    l.e2e_ms.mean, l.e2e_ms.p50, l.e2e_ms.p99
                ),
                format!("{:.2}", l.achieved_concurrency),
            ]);
            if let Some(a) = l.accept_length {
                numbers.push(format!("{a:.2}"));
            }
        }
    }
    for n in &numbers {
        assert!(doc.contains(n.as_str()), "production.md lacks `{n}`");
    }

    // The same machine: no drift. A changed fingerprint field: drift, non-zero exit.
    let doctor = kiln(&["doctor", "--lock", &s(&lock_path)]);
    ok(&doctor, "doctor on the locking machine");
    let mut drifted = lock.clone();
    drifted.fingerprint.kernel = "1.0.0-other".into();
    drifted.env.insert("NCCL_ALGO".into(), "Ring".into());
    let drifted_path = dir.join("drifted.lock");
    drifted.write(&drifted_path).expect("write drifted lock");
    let d = kiln(&["doctor", "--lock", &s(&drifted_path)]);
    assert!(!d.status.success(), "drift must fail the doctor");
    let text = String::from_utf8_lossy(&d.stdout);
    assert!(
        text.contains("drift kernel") && text.contains("1.0.0-other"),
        "{text}"
    );

    // serve --lock refuses conflicting flags, and refuses drift when the policy says so.
    let conflict = kiln(&[
        "serve",
        "--lock",
        &s(&lock_path),
        "--port",
        "1",
        "--mode",
        "exact",
    ]);
    assert!(!conflict.status.success());
    let msg = String::from_utf8_lossy(&conflict.stderr);
    assert!(msg.contains("--port") && msg.contains("--mode"), "{msg}");
    let refused = kiln(&[
        "serve",
        "--lock",
        &s(&drifted_path),
        "--drift-policy",
        "refuse",
    ]);
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("drifted"));

    // With the warn policy it serves, runs the canary, and shows the drift.
    let mut server = Server::start_exactly(
        port,
        &["--lock", &s(&drifted_path), "--canary", "--skip-model-hash"],
    );
    let (status, ready) = server.request("GET", "/ready", &[], b"");
    assert_eq!(status, 200);
    let ready: serde_json::Value = serde_json::from_str(&ready).expect("ready json");
    assert_eq!(ready["config"], "baseline");
    assert_eq!(ready["drifted"], true);
    let names: Vec<&str> = ready["drift"]
        .as_array()
        .expect("drift list")
        .iter()
        .filter_map(|c| c["name"].as_str())
        .collect();
    assert!(names.contains(&"drift kernel"), "{names:?}");
    assert!(server.metric("kiln_canary_ratio") > 0.0);
    let (_, metrics) = server.request("GET", "/metrics", &[], b"");
    assert!(
        metrics.lines().any(|l| l.starts_with("kiln_lock_drift{")
            && l.contains("check=\"drift kernel\"")
            && l.ends_with(" 1")),
        "{metrics}"
    );
    // And `kiln bench --url` drives the locked server from the command line.
    let bench_stem = dir.join("cli");
    let out = ok(
        &kiln(&[
            "bench",
            "--url",
            &server.base_url(),
            "--concurrency",
            "2",
            "--num-prompts",
            "2",
            "--max-tokens",
            "4",
            "--dataset",
            "bfcl",
            "--out",
            &s(&bench_stem),
        ]),
        "bench --url",
    );
    assert!(out.contains("| 2 | 2 / 0 |"), "{out}");
    assert!(server.terminate().success());
    let _ = std::fs::remove_dir_all(dir);
}

/// A fake OpenAI server: /v1/models answers; completions fail with 500, or never finish.
fn fake_server(behaviour: &'static str) -> (String, tokio::runtime::Runtime) {
    use axum::routing::{get, post};
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let app = axum::Router::new()
        .route(
            "/v1/models",
            get(|| async { axum::Json(serde_json::json!({"data": [{"id": "fake"}]})) }),
        )
        .route(
            "/v1/chat/completions",
            post(move || async move {
                use axum::response::IntoResponse;
                match behaviour {
                    "fail" => {
                        (axum::http::StatusCode::INTERNAL_SERVER_ERROR, "boom").into_response()
                    }
                    _ => {
                        // Headers, one chunk, then silence: a stalled stream.
                        let first = futures::stream::once(async {
                            Ok::<_, std::convert::Infallible>(
                                "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n",
                            )
                        });
                        let stall = futures::stream::once(async {
                            tokio::time::sleep(Duration::from_secs(3600)).await;
                            Ok::<_, std::convert::Infallible>("")
                        });
                        let body =
                            axum::body::Body::from_stream(futures::StreamExt::chain(first, stall));
                        ([("content-type", "text/event-stream")], body).into_response()
                    }
                }
            }),
        );
    rt.spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (format!("http://{addr}"), rt)
}

#[test]
fn bench_counts_errors_from_failing_and_stalled_servers_in_bounded_time() {
    let dir = tempdir("bench-errors");
    for (behaviour, kind) in [("fail", "HTTP 500"), ("stall", "timeout")] {
        let (url, _rt) = fake_server(behaviour);
        let stem = dir.join(behaviour);
        let t0 = Instant::now();
        let out = ok(
            &kiln(&[
                "bench",
                "--url",
                &url,
                "--concurrency",
                "1,3",
                "--num-prompts",
                "3",
                "--max-tokens",
                "4",
                "--request-timeout",
                "1",
                "--out",
                &s(&stem),
            ]),
            behaviour,
        );
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "{behaviour}: bounded in time"
        );
        assert!(
            out.contains("| 1 | 0 / 3 |") && out.contains("| 3 | 0 / 3 |"),
            "{out}"
        );
        let result: kiln::bench::BenchResult = serde_json::from_str(
            &std::fs::read_to_string(dir.join(format!("{behaviour}.json"))).expect("json"),
        )
        .expect("parse");
        for l in &result.levels {
            assert_eq!(l.errors.get(kind), Some(&3), "{behaviour}: {:?}", l.errors);
        }
    }
    // Nothing listening: a clear error, not a hang.
    let port = free_port();
    let out = kiln(&[
        "bench",
        "--url",
        &format!("http://127.0.0.1:{port}"),
        "--out",
        &s(&dir.join("none")),
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains(&format!("127.0.0.1:{port}")));
    let _ = std::fs::remove_dir_all(dir);
}
