//! `kiln systemd-unit`: the generated unit passes `systemd-analyze verify`, scores an exposure of
//! at most 2.0 in `systemd-analyze security --offline=true`, and carries the module's directives.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use kiln::bench::{BenchResult, BenchSettings, LevelResult};
use kiln::lock::{Fingerprint, Sweep, SweepConfig};

fn tempdir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-unit-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// A lock on the default model, as if made on a machine with `gpus`.
fn write_lock(dir: &Path, gpus: usize) -> PathBuf {
    let model = common::smollm2();
    let serve: toml::Table = toml::from_str(&format!(
        "model = {:?}\nhost = \"127.0.0.1\"\nport = 8000\nshutdown-timeout = 30\n",
        model.to_string_lossy()
    ))
    .expect("serve table");
    let sweep = Sweep {
        created: 0,
        fingerprint: Fingerprint {
            gpus: vec!["NVIDIA RTX PRO 6000 Blackwell Server Edition".into(); gpus],
            ..Default::default()
        },
        env: [("NCCL_P2P_LEVEL".to_string(), "SYS".to_string())].into(),
        bench: BenchSettings::default(),
        configs: vec![SweepConfig {
            name: "baseline".into(),
            serve,
            result: BenchResult {
                label: "baseline".into(),
                url: String::new(),
                model: "m".into(),
                settings: BenchSettings::default(),
                started: 0,
                levels: vec![LevelResult {
                    concurrency: 1,
                    output_tok_s: 80.0,
                    ..Default::default()
                }],
            },
        }],
    };
    let lock = sweep
        .lock("baseline", None, "sweep.json", kiln::lock::hash_file)
        .expect("lock");
    let path = dir.join(format!("gpu{gpus}.lock"));
    lock.write(&path).expect("write lock");
    path
}

fn analyze(args: &[&str]) -> std::process::Output {
    Command::new("systemd-analyze")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("systemd-analyze: {e} (apt-get install systemd)"))
}

#[test]
fn generated_units_verify_and_are_hardened() {
    let dir = tempdir();
    let key = dir.join("api-key");
    std::fs::write(&key, "secret\n").expect("key");
    for gpus in [0, 8] {
        let lock = write_lock(&dir, gpus);
        let unit = dir.join(format!("kiln-gpu{gpus}.service"));
        let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(["systemd-unit", "--lock"])
            .arg(&lock)
            .args(["--name", &format!("gpu{gpus}"), "--api-key-file"])
            .arg(&key)
            .arg("-o")
            .arg(&unit)
            .output()
            .expect("kiln systemd-unit");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = std::fs::read_to_string(&unit).expect("unit");
        for directive in [
            "Type=notify",
            "LimitMEMLOCK=infinity",
            "TimeoutStartSec=900",
            "Restart=on-failure",
            "StartLimitBurst=",
            "WatchdogSec=60",
            "DynamicUser=yes",
            "StateDirectory=kiln/",
            "ProtectSystem=strict",
            "DevicePolicy=closed",
            "WantedBy=multi-user.target",
            "Environment=\"NCCL_P2P_LEVEL=SYS\"",
            "LoadCredential=api-key:",
            "--api-key-file ${CREDENTIALS_DIRECTORY}/api-key",
            "LimitCORE=0",
            "LimitNOFILE=1048576",
            "LogRateLimitBurst=",
        ] {
            assert!(
                text.contains(directive),
                "gpus={gpus}: no {directive}\n{text}"
            );
        }
        assert!(
            text.contains(&format!("serve --instance gpu{gpus} --lock ")),
            "gpus={gpus}: no --instance before --lock\n{text}"
        );
        if gpus > 0 {
            assert!(text.contains("After=network-online.target nvidia-persistenced.service"));
            assert!(text.contains("DeviceAllow=char-nvidia-uvm rw"));
            assert!(text.contains("PrivateDevices=no"));
            assert!(text.contains("Environment=CUDA_DEVICE_ORDER=PCI_BUS_ID"));
            // Eight GPUs: NCCL's NUMA binding, netlink, and its bootstrap over loopback.
            assert!(text.contains("SystemCallFilter=~@privileged\n"), "{text}");
            assert!(text.contains(" AF_NETLINK\n"), "{text}");
            assert!(text.contains("Environment=NCCL_SOCKET_IFNAME=lo"), "{text}");
        } else {
            assert!(text.contains("PrivateDevices=yes"));
            assert!(text.contains("SystemCallFilter=~@privileged @resources\n"));
            assert!(!text.contains("AF_NETLINK"));
            assert!(!text.contains("nvidia"));
        }
        let v = analyze(&["verify", &unit.to_string_lossy()]);
        assert!(
            v.status.success(),
            "systemd-analyze verify: {}{}",
            String::from_utf8_lossy(&v.stdout),
            String::from_utf8_lossy(&v.stderr)
        );
        let s = analyze(&["security", "--offline=true", &unit.to_string_lossy()]);
        let report = String::from_utf8_lossy(&s.stdout).into_owned();
        let score: f64 = report
            .lines()
            .find_map(|l| l.split("Overall exposure level for").nth(1))
            .and_then(|l| l.split(':').nth(1))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no exposure score in:\n{report}"));
        eprintln!("gpus={gpus}: exposure {score}");
        assert!(
            score <= 2.0,
            "gpus={gpus}: exposure {score} > 2.0\n{report}"
        );
    }
    // A binary under a home or temporary directory: the unit could not execute it.
    for place in ["/tmp/kiln", "/home/op/kiln"] {
        let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(["systemd-unit", "--name", "t", "--exec", place])
            .output()
            .expect("kiln systemd-unit");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && err.contains("warning") && err.contains(place),
            "{place}: {err}"
        );
    }
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args([
            "systemd-unit",
            "--name",
            "t",
            "--exec",
            "/usr/local/bin/kiln",
        ])
        .output()
        .expect("kiln systemd-unit");
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("warning"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bad = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["systemd-unit", "--name", "no spaces"])
        .output()
        .expect("kiln");
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--name"));
    let _ = std::fs::remove_dir_all(dir);
}
