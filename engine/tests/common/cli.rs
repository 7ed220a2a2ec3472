//! Running the `kiln` binary from a test, and the scratch files such tests write.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn kiln(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .output()
        .expect("run kiln")
}

/// The stdout of a run that must succeed (its stderr in the failure message).
pub fn ok(out: &Output, what: &str) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{what} failed: {stderr}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A fresh, empty directory of this test process.
pub fn tempdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

pub fn s(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}
