//! Coming from SGLang, end to end: the reference's launch line and a systemd unit running it
//! go through `kiln import sglang`; the config it writes starts `kiln serve --config` (on the
//! CPU, the small model and a small EAGLE-3 head substituted for Kimi-K2's), drafting as the
//! line asked; its sweep goes through `kiln bench sweep` and `kiln lock create`; SGLang's own
//! spellings of the shared flags start `kiln serve` as written; what kiln does not know is
//! refused by name.

mod common;

use std::path::Path;

use common::cli::{kiln, ok, s, tempdir};
use common::server::{Server, free_port};

const REFERENCE: &str = "SGLANG_ENABLE_SPEC_V2=True NCCL_P2P_LEVEL=SYS python -m \
    sglang.launch_server --model-path /models/kimi-k2 --tp 8 --speculative-algorithm EAGLE3 \
    --speculative-draft-model-path /models/kimi-k2-eagle3 --speculative-num-steps 3 \
    --speculative-eagle-topk 1 --speculative-num-draft-tokens 4 --mem-fraction-static 0.85 \
    --host 0.0.0.0 --port 30000 --trust-remote-code\n";

/// A small EAGLE-3 head for the default model (drafting only from "," so drafts are made).
fn draft_head(dir: &Path) -> String {
    let tok = common::smollm2_tokenizer();
    let comma = tok.encode(",", false).expect("encode");
    let head = dir.join("eagle3-head");
    common::write_small_vocab_draft(&head, &comma);
    s(&head)
}

#[test]
fn the_reference_launch_becomes_a_config_that_serves_and_a_sweep_that_locks() {
    let dir = tempdir("import-sglang");
    let unit = dir.join("sglang.service");
    std::fs::write(
        &unit,
        format!(
            "[Unit]\nDescription=SGLang\nAfter=network-online.target\n\n[Service]\n\
             Environment=SGLANG_ENABLE_SPEC_V2=True\nEnvironment=\"NCCL_P2P_LEVEL=SYS\" \
             CUDA_DEVICE_ORDER=PCI_BUS_ID\nExecStart=/opt/sglang/bin/python3 -m \
             sglang.launch_server {}Restart=always\n",
            REFERENCE
                .split("sglang.launch_server ")
                .nth(1)
                .expect("flags")
        ),
    )
    .expect("unit");
    let line = dir.join("launch.sh");
    std::fs::write(&line, REFERENCE).expect("line");

    // The plain line: every flag and variable gets its verdict.
    let config = dir.join("line.toml");
    let report = ok(
        &kiln(&["import", "sglang", &s(&line), "-o", &s(&config)]),
        "import the line",
    );
    for needle in [
        "mapped      --tp 8  ->  tensor-parallel-size = 8",
        "mapped      --speculative-algorithm EAGLE3  ->  speculative-algorithm = \"eagle3\"",
        "mapped      --mem-fraction-static 0.85",
        "kept        NCCL_P2P_LEVEL=SYS",
        "not needed  SGLANG_ENABLE_SPEC_V2=True",
        "not needed  --trust-remote-code",
    ] {
        assert!(report.contains(needle), "{needle} missing from:\n{report}");
    }
    assert_eq!(report.lines().count(), 2 + 11 + 1, "{report}");
    let again = kiln(&["import", "sglang", &s(&line), "-o", &s(&config)]);
    assert!(
        !again.status.success() && String::from_utf8_lossy(&again.stderr).contains("--force"),
        "an existing config is not overwritten silently"
    );

    // The unit: the same settings, and the environment file keeps NCCL and CUDA variables.
    let unit_dir = dir.join("unit");
    std::fs::create_dir_all(&unit_dir).expect("dir");
    let unit_config = unit_dir.join("kiln.toml");
    ok(
        &kiln(&["import", "sglang", &s(&unit), "-o", &s(&unit_config)]),
        "import the unit",
    );
    let read = |p: &Path| std::fs::read_to_string(p).expect("read");
    let settings = |p: &Path| -> toml::Table {
        let t: toml::Table = toml::from_str(&read(p)).expect("toml");
        t
    };
    assert_eq!(settings(&config), settings(&unit_config));
    assert_eq!(
        read(&unit_dir.join("kiln.env"))
            .lines()
            .filter(|l| !l.starts_with('#'))
            .collect::<Vec<_>>(),
        ["NCCL_P2P_LEVEL=SYS", "CUDA_DEVICE_ORDER=PCI_BUS_ID"]
    );

    // The config serves, on the CPU, with the small model and head in place of Kimi-K2's
    // (tensor parallelism 1: 8 ranks do not divide the small model's 9 heads), and drafts.
    let head = draft_head(&dir);
    let model = s(&common::smollm2());
    let port = free_port();
    let port_text = port.to_string();
    let server = Server::start_exactly(
        port,
        &[
            "--config",
            &s(&config),
            "--model",
            &model,
            "--device",
            "cpu",
            "--tp",
            "1",
            "--speculative-draft-model-path",
            &head,
            "--speculative-policy",
            "fixed",
            "--kv-tokens",
            "4096",
            "--threads",
            "1",
            "--host",
            "127.0.0.1",
            "--port",
            &port_text,
        ],
    );
    let (_, models) = server.request("GET", "/v1/models", &[], b"");
    let models: serde_json::Value = serde_json::from_str(&models).expect("models json");
    let (status, body) = server.post_json(
        "/v1/completions",
        &serde_json::json!({
            "model": models["data"][0]["id"],
            "prompt": "1, 2, 3, 4, 5, 6, 7, 8,",
            "max_tokens": 16,
            "temperature": 0
        }),
    );
    assert_eq!(status, 200, "{body}");
    assert!(
        server.metric("kiln_spec_draft_tokens_total") > 0.0,
        "the imported EAGLE3 setting drafts"
    );
    drop(server);

    // Its sweep, with the same substitutions and a short bench, locks.
    let sweep_file = dir.join("kiln-sweep.toml");
    let mut sweep: toml::Table = toml::from_str(&read(&sweep_file)).expect("sweep toml");
    let serve = sweep
        .get_mut("serve")
        .and_then(|v| v.as_table_mut())
        .expect("[serve]");
    for (k, v) in [
        ("model", toml::Value::String(model.clone())),
        ("device", "cpu".into()),
        ("tensor-parallel-size", 1.into()),
        ("speculative-draft-model-path", head.clone().into()),
        ("kv-tokens", 4096.into()),
        ("threads", 1.into()),
        ("host", "127.0.0.1".into()),
        ("port", i64::from(free_port()).into()),
    ] {
        serve.insert(k.into(), v);
    }
    serve.remove("mem-fraction-static");
    sweep.insert(
        "bench".into(),
        toml::Value::Table(
            toml::from_str("concurrency = [1]\nnum-prompts = 2\nmax-tokens = 8").expect("bench"),
        ),
    );
    let small = dir.join("small-sweep.toml");
    std::fs::write(&small, toml::to_string(&sweep).expect("render")).expect("write");
    let stem = dir.join("sweep");
    ok(
        &kiln(&["bench", "sweep", &s(&small), "--out", &s(&stem)]),
        "bench sweep",
    );
    ok(
        &kiln(&[
            "lock",
            "create",
            "--from",
            &s(&dir.join("sweep.json")),
            "--choose",
            "sglang-import",
            "-o",
            &s(&dir.join("kiln.lock")),
        ]),
        "lock create",
    );
    let lock = read(&dir.join("kiln.lock"));
    assert!(
        lock.contains("speculative-algorithm = \"eagle3\""),
        "{lock}"
    );
    // The head is a directory: the lock hashes its files, and the doctor notices a change.
    let lock_path = s(&dir.join("kiln.lock"));
    let doctor = ok(&kiln(&["doctor", "--lock", &lock_path]), "doctor");
    assert!(
        doctor
            .lines()
            .any(|l| l.contains("draft") && l.contains("sha256 matches")),
        "{doctor}"
    );
    let config_json = Path::new(&head).join("config.json");
    let mut edited = read(&config_json);
    edited.push(' ');
    std::fs::write(&config_json, edited).expect("edit the head");
    let drifted = kiln(&["doctor", "--lock", &lock_path]);
    let text = String::from_utf8_lossy(&drifted.stdout);
    assert!(!drifted.status.success(), "{text}");
    assert!(
        text.lines()
            .any(|l| l.contains("draft") && l.contains("bytes, locked")),
        "{text}"
    );
}

#[test]
fn what_kiln_does_not_know_is_refused_by_name_and_nothing_is_written() {
    let dir = tempdir("import-refused");
    let line = dir.join("launch.sh");
    std::fs::write(
        &line,
        "SGLANG_TORCH_PROFILER_DIR=/tmp python -m sglang.launch_server --model-path /m \
         --enable-dp-attention --tp 8\n",
    )
    .expect("line");
    let out = kiln(&[
        "import",
        "sglang",
        &s(&line),
        "-o",
        &s(&dir.join("kiln.toml")),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("SGLANG_TORCH_PROFILER_DIR=/tmp")
            && stderr.contains("--enable-dp-attention"),
        "{stderr}"
    );
    assert!(!dir.join("kiln.toml").exists());
}

#[test]
fn sglang_s_spellings_of_shared_flags_start_kiln_serve_as_written() {
    let model = s(&common::smollm2());
    let port = free_port();
    let port_text = port.to_string();
    let server = Server::start_exactly(
        port,
        &[
            "--model-path",
            &model,
            "--tp-size",
            "1",
            "--speculative-algorithm",
            "NGRAM",
            "--max-running-requests",
            "8",
            "--context-length",
            "1024",
            "--chunked-prefill-size",
            "256",
            "--disable-radix-cache",
            "--disable-overlap-schedule",
            "--disable-cuda-graph",
            "--cuda-graph-max-bs",
            "16",
            "--served-model-name",
            "kimi-k2",
            "--kv-tokens",
            "4096",
            "--threads",
            "1",
            "--port",
            &port_text,
        ],
    );
    let (status, info) = server.post_json(
        "/v1/completions",
        &serde_json::json!({
            "model": "kimi-k2", "prompt": "a b a b a b a b", "max_tokens": 8, "temperature": 0
        }),
    );
    assert_eq!(status, 200, "{info}");
    let (_, model_info) = server.request("GET", "/model_info", &[], b"");
    let v: serde_json::Value = serde_json::from_str(&model_info).expect("json");
    assert_eq!(v["context_length"], 1024, "{v}");
    assert_eq!(v["max_running_requests"], 8, "{v}");
    assert_eq!(v["speculative_algorithm"], "ngram", "{v}");
    assert_eq!(v["overlap_schedule"], false, "{v}");
    assert_eq!(v["model"], "kimi-k2", "{v}");
}
