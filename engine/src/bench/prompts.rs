//! Prompt sets for `kiln bench`: coding (HumanEval) and agentic function calling (BFCL v4),
//! embedded from `assets/prompts/` (see its `extract.py` and `LICENSES.md`), or any JSONL file whose
//! lines hold `{"messages": [...]}` or `{"prompt": "..."}`.

use std::path::Path;

use serde::Deserialize;

const HUMANEVAL: &str = include_str!("../../assets/prompts/humaneval.jsonl");
const BFCL: &str = include_str!("../../assets/prompts/bfcl.jsonl");

/// One benchmark request body's input: chat messages, or a raw completion prompt.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Chat(Vec<serde_json::Value>),
    Text(String),
}

#[derive(Deserialize)]
struct Line {
    #[serde(default)]
    messages: Option<Vec<serde_json::Value>>,
    #[serde(default)]
    prompt: Option<String>,
}

/// The named sets: `humaneval`, `bfcl`, and `mixed` (the two interleaved, as the seed's coding and
/// agentic traffic).
pub fn named(name: &str) -> Result<Vec<Prompt>, String> {
    match name {
        "humaneval" => parse(HUMANEVAL, "humaneval"),
        "bfcl" => parse(BFCL, "bfcl"),
        "mixed" => {
            let a = parse(HUMANEVAL, "humaneval")?;
            let b = parse(BFCL, "bfcl")?;
            let mut out = Vec::with_capacity(a.len() + b.len());
            for (x, y) in a.into_iter().zip(b) {
                out.push(x);
                out.push(y);
            }
            Ok(out)
        }
        other => Err(format!(
            "unknown dataset `{other}` (known: humaneval, bfcl, mixed, or a .jsonl file)"
        )),
    }
}

/// A named set, or a JSONL file when `spec` names an existing file.
pub fn load(spec: &str) -> Result<Vec<Prompt>, String> {
    let path = Path::new(spec);
    if path.is_file() {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{spec}: {e}"))?;
        return parse(&text, spec);
    }
    named(spec)
}

fn parse(text: &str, source: &str) -> Result<Vec<Prompt>, String> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let l: Line =
            serde_json::from_str(line).map_err(|e| format!("{source}: line {}: {e}", i + 1))?;
        match (l.messages, l.prompt) {
            (Some(m), _) if !m.is_empty() => out.push(Prompt::Chat(m)),
            (_, Some(p)) => out.push(Prompt::Text(p)),
            _ => {
                return Err(format!(
                    "{source}: line {}: needs a non-empty `messages` or a `prompt`",
                    i + 1
                ));
            }
        }
    }
    if out.is_empty() {
        return Err(format!("{source}: no prompts"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_sets_are_complete() {
        assert_eq!(named("humaneval").expect("humaneval").len(), 164);
        assert_eq!(named("bfcl").expect("bfcl").len(), 164);
        let mixed = named("mixed").expect("mixed");
        assert_eq!(mixed.len(), 328);
        assert_ne!(mixed[0], mixed[1]);
    }

    #[test]
    fn bad_files_name_the_line() {
        let err = parse("{\"prompt\": \"a\"}\n{\"x\": 1}\n", "f.jsonl").expect_err("bad");
        assert!(err.contains("f.jsonl: line 2"), "{err}");
        assert!(named("nope").is_err());
    }
}
