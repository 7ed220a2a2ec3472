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

/// The named sets: `humaneval`, `bfcl`, `mixed` (the two interleaved, as the seed's coding and
/// agentic traffic), and two that share prefixes (what a prefix cache is for): `shared-doc`
/// (questions over one ~1,500-token document) and `multi-turn` (one conversation, each request
/// one turn longer than the one before).
pub fn named(name: &str) -> Result<Vec<Prompt>, String> {
    match name {
        "shared-doc" => shared_document(),
        "multi-turn" => multi_turn(),
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
            "unknown dataset `{other}` (known: humaneval, bfcl, mixed, shared-doc, multi-turn, \
             or a .jsonl file)"
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

/// The code of the first HumanEval tasks: the text the shared-prefix sets are made of.
fn humaneval_code() -> Result<Vec<String>, String> {
    Ok(parse(HUMANEVAL, "humaneval")?
        .into_iter()
        .filter_map(|p| match p {
            Prompt::Chat(m) => m
                .first()
                .and_then(|m| m["content"].as_str())
                .and_then(|c| c.split("```python\n").nth(1))
                .map(|c| c.trim_end_matches("```").to_string()),
            Prompt::Text(_) => None,
        })
        .collect())
}

/// 64 questions, each about one function of the same ~1,500-token module.
fn shared_document() -> Result<Vec<Prompt>, String> {
    let code = humaneval_code()?;
    let module: String = code.iter().take(12).map(String::as_str).collect();
    let names: Vec<&str> = module
        .lines()
        .filter_map(|l| l.strip_prefix("def "))
        .filter_map(|l| l.split('(').next())
        .collect();
    if names.is_empty() {
        return Err("shared-doc: no functions in the embedded module".into());
    }
    Ok((0..64)
        .map(|k| {
            let name = names[k % names.len()];
            let ask = match k / names.len() % 3 {
                0 => "What does it return for an empty input?",
                1 => "Write one more doctest for it.",
                _ => "Describe its algorithm in two sentences.",
            };
            Prompt::Chat(vec![serde_json::json!({
                "role": "user",
                "content": format!("Here is a Python module:\n\n```python\n{module}```\n\n\
                                    About `{name}`: {ask}"),
            })])
        })
        .collect())
}

/// One conversation of 32 user turns (HumanEval tasks): request k carries the first k + 1 turns,
/// each earlier one answered with a short fixed reply.
fn multi_turn() -> Result<Vec<Prompt>, String> {
    let code = humaneval_code()?;
    let turns: Vec<serde_json::Value> = code
        .iter()
        .take(32)
        .map(|c| {
            serde_json::json!({
                "role": "user",
                "content": format!("Next function:\n```python\n{c}```\nComplete it."),
            })
        })
        .collect();
    Ok((0..turns.len())
        .map(|k| {
            let mut messages = Vec::with_capacity(2 * k + 1);
            for t in &turns[..k] {
                messages.push(t.clone());
                messages.push(serde_json::json!({
                    "role": "assistant", "content": "Done; it passes its doctests."
                }));
            }
            messages.push(turns[k].clone());
            Prompt::Chat(messages)
        })
        .collect())
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

    fn text(p: &Prompt) -> String {
        match p {
            Prompt::Chat(m) => m.iter().filter_map(|m| m["content"].as_str()).collect(),
            Prompt::Text(t) => t.clone(),
        }
    }

    #[test]
    fn the_shared_prefix_sets_share_their_prefixes() {
        let doc = named("shared-doc").expect("shared-doc");
        assert_eq!(doc.len(), 64);
        let (a, b) = (text(&doc[0]), text(&doc[1]));
        assert_ne!(a, b);
        let common = a.chars().zip(b.chars()).take_while(|(x, y)| x == y).count();
        // About 1,500 tokens of code: well over 4,000 characters in common.
        assert!(
            common > 4000 && common + 200 > a.len(),
            "{common} of {}",
            a.len()
        );
        let turns = named("multi-turn").expect("multi-turn");
        assert_eq!(turns.len(), 32);
        for k in 1..turns.len() {
            let (Prompt::Chat(before), Prompt::Chat(now)) = (&turns[k - 1], &turns[k]) else {
                panic!("chat prompts");
            };
            assert_eq!(now.len(), before.len() + 2);
            assert_eq!(
                now[..before.len()],
                before[..],
                "turn {k} extends turn {}",
                k - 1
            );
        }
    }

    #[test]
    fn bad_files_name_the_line() {
        let err = parse("{\"prompt\": \"a\"}\n{\"x\": 1}\n", "f.jsonl").expect_err("bad");
        assert!(err.contains("f.jsonl: line 2"), "{err}");
        assert!(named("nope").is_err());
    }
}
