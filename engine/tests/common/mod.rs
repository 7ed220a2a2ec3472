//! Shared helpers for integration tests: where the real models are, and fixture loading.
#![allow(dead_code)]

use std::path::PathBuf;

use kiln::catalog::{CatalogEntry, DEFAULT_MODEL, QWEN_CODER};

/// The cached model file; fails with the command that fetches it (these tests need real weights).
pub fn model_path(entry: &CatalogEntry) -> PathBuf {
    let cache = match std::env::var_os("KILN_CACHE_DIR") {
        Some(p) => PathBuf::from(p),
        None => kiln::catalog::cache_dir(
            std::env::var("XDG_CACHE_HOME").ok().as_deref(),
            std::env::var("HOME").ok().as_deref(),
        ),
    };
    match entry.require(&cache) {
        Ok(p) => p,
        Err(e) => {
            panic!("{e}\n(the real-model tests need `cargo run --release -- fetch --model all`)")
        }
    }
}

pub fn smollm2() -> PathBuf {
    model_path(&DEFAULT_MODEL)
}

pub fn qwen() -> PathBuf {
    model_path(&QWEN_CODER)
}

pub fn fixture(name: &str) -> serde_json::Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}
