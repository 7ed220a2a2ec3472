//! Each family's real output format, as the peers document and test it (SGLang's
//! `python/sglang/srt/function_call/*_detector.py` docstrings and
//! `test/srt/test_function_call_parser.py`; the models' own chat templates for hermes / Qwen2.5
//! and Kimi-K2), parsed whole and streamed in small pieces.

use serde_json::{Value, json};

use super::*;
use crate::server::protocol::{FunctionDef, ToolDef};

fn tools(parser: &'static str) -> Tools {
    Tools {
        defs: vec![ToolDef {
            kind: "function".into(),
            function: FunctionDef {
                name: "get_weather".into(),
                description: Some("Current weather".into()),
                parameters: Some(json!({"type": "object",
                    "properties": {"city": {"type": "string"}}, "required": ["city"]})),
                strict: None,
            },
        }],
        choice: Choice::Auto,
        parallel: true,
        parser,
    }
}

/// (parser, the model's text) for every family kiln names.
fn samples() -> Vec<(&'static str, String)> {
    vec![
        (
            "qwen",
            "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"
                .into(),
        ),
        (
            "llama",
            "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}".into(),
        ),
        (
            "mistral",
            "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]".into(),
        ),
        (
            "deepseek",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
                .into(),
        ),
        (
            "deepseek31",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
                .into(),
        ),
        (
            "kimik2",
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|><|tool_calls_section_end|>"
                .into(),
        ),
    ]
}

fn arguments(call: &Value) -> Value {
    let text = call["function"]["arguments"]
        .as_str()
        .expect("arguments string");
    serde_json::from_str(text).expect("arguments JSON")
}

#[test]
fn every_family_parses_whole_into_openai_calls() {
    for (parser, text) in samples() {
        let (content, calls) = parse_complete(&tools(parser), &text);
        assert_eq!(calls.len(), 1, "{parser}: {text}");
        assert_eq!(calls[0]["function"]["name"], "get_weather", "{parser}");
        assert_eq!(arguments(&calls[0]), json!({"city": "Paris"}), "{parser}");
        assert_eq!(calls[0]["type"], "function");
        if parser == "kimik2" {
            assert_eq!(calls[0]["id"], "functions.get_weather:0");
        } else {
            assert!(
                calls[0]["id"]
                    .as_str()
                    .is_some_and(|id| id.starts_with("call_"))
            );
        }
        if parser == "qwen" {
            assert_eq!(content.as_deref(), Some("Let me check."));
        }
    }
}

/// The text in the pieces a server streams: each marker whole (a model writes it as one special
/// token), other text three characters at a time.
fn pieces_as_streamed(text: &str) -> Vec<String> {
    let mut pieces = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let marker = ["<｜", "<|", "[TOOL_CALLS]"]
            .iter()
            .filter(|open| rest.starts_with(**open))
            .find_map(|open| match *open {
                "[TOOL_CALLS]" => Some(open.len()),
                _ => {
                    let close = if *open == "<|" { "|>" } else { "｜>" };
                    rest[open.len()..]
                        .find(close)
                        .map(|e| open.len() + e + close.len())
                }
            });
        let take = marker.unwrap_or_else(|| {
            let next_marker = ["<｜", "<|", "[TOOL_CALLS]"]
                .iter()
                .filter_map(|m| rest[1..].find(m).map(|i| i + 1))
                .min()
                .unwrap_or(rest.len());
            rest.char_indices()
                .map(|(i, _)| i)
                .chain([rest.len()])
                .nth(3)
                .unwrap_or(rest.len())
                .min(next_marker)
        });
        pieces.push(rest[..take].to_string());
        rest = &rest[take..];
    }
    pieces
}

#[test]
fn every_family_streams_a_call_that_reassembles() {
    for (parser, text) in samples() {
        let mut s = StreamCalls::new(&tools(parser)).expect("parser");
        let mut content = String::new();
        let mut name = None;
        let mut args = String::new();
        let pieces = pieces_as_streamed(&text);
        for (i, piece) in pieces.iter().enumerate() {
            let (c, deltas) = s.feed(piece, i + 1 == pieces.len());
            content.push_str(&c);
            for d in deltas {
                assert_eq!(d["index"], 0, "{parser}");
                if let Some(n) = d["function"]["name"].as_str() {
                    assert!(name.is_none(), "{parser}: the name comes once");
                    assert!(d["id"].is_string(), "{parser}: the id comes with the name");
                    name = Some(n.to_string());
                }
                args.push_str(d["function"]["arguments"].as_str().unwrap_or(""));
            }
        }
        assert_eq!(
            name.as_deref(),
            Some("get_weather"),
            "{parser}: {content:?}"
        );
        let args: Value =
            serde_json::from_str(&args).unwrap_or_else(|e| panic!("{parser}: {args}: {e}"));
        assert_eq!(args, json!({"city": "Paris"}), "{parser}");
        assert!(s.called());
        assert!(!content.contains("get_weather"), "{parser}: {content:?}");
    }
}

#[test]
fn text_without_a_call_stays_content() {
    for (parser, _) in samples() {
        let text = "No tool needed: it is sunny.";
        let (content, calls) = parse_complete(&tools(parser), text);
        assert!(calls.is_empty(), "{parser}");
        assert_eq!(content.as_deref(), Some(text), "{parser}");
    }
    // A broken call is content too, never an error.
    let broken =
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \n</tool_call>";
    let (content, calls) = parse_complete(&tools("qwen"), broken);
    assert!(calls.is_empty());
    assert!(content.is_some());
}

#[test]
fn formats_resolve_by_flag_or_template_markers() {
    assert_eq!(resolve(Some("hermes"), None), Ok(Some("qwen")));
    assert_eq!(resolve(Some("kimi_k2"), None), Ok(Some("kimik2")));
    assert!(resolve(Some("nope"), None).is_err_and(|e| e.contains("qwen25")));
    assert_eq!(resolve(None, Some("{{ '<tool_call>' }}")), Ok(Some("qwen")));
    assert_eq!(
        resolve(None, Some("<|tool_calls_section_begin|>")),
        Ok(Some("kimik2"))
    );
    assert_eq!(resolve(None, Some("plain chat")), Ok(None));
}

/// The formats' markers, as special tokens of a byte-per-token vocabulary.
const MARKERS: &[&str] = &[
    "<tool_call>",
    "</tool_call>",
    "[TOOL_CALLS]",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
];

/// A matcher for `grammar` over bytes 0..=254 (ids = byte values), an end token (255) and the
/// markers as special tokens (256 on).
fn byte_matcher(grammar: &str) -> llguidance::Matcher {
    use llguidance::toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie};
    let mut words: Vec<Vec<u8>> = (0..=254u8).map(|b| vec![b]).collect();
    words.push(b"\xFF<end>".to_vec());
    words.extend(
        MARKERS
            .iter()
            .map(|m| std::iter::once(0xFF).chain(m.bytes()).collect()),
    );
    let info = TokRxInfo::new(words.len() as u32, 255);
    let env: llguidance::toktrie::TokEnv =
        std::sync::Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words)));
    let factory = llguidance::ParserFactory::new_simple(&env).expect("factory");
    let parser = factory
        .create_parser(llguidance::api::TopLevelGrammar::from_lark(grammar.into()))
        .expect("the grammar compiles");
    llguidance::Matcher::new(Ok(parser))
}

/// `text` in that vocabulary, markers as their special tokens when `special`.
fn byte_tokens(text: &str, special: bool) -> Vec<u32> {
    let mut out = Vec::new();
    let mut rest = text.as_bytes();
    'outer: while let Some(&first) = rest.first() {
        if special {
            for (i, m) in MARKERS.iter().enumerate() {
                if let Some(after) = rest.strip_prefix(m.as_bytes()) {
                    out.push(256 + i as u32);
                    rest = after;
                    continue 'outer;
                }
            }
        }
        out.push(u32::from(first));
        rest = &rest[1..];
    }
    out
}

#[test]
fn a_forced_call_is_the_format_each_parser_reads() {
    for (parser, sample) in samples() {
        // The call alone: no text before it, no `<|python_tag|>` (Llama 3.1 writes custom
        // tools' calls as bare JSON).
        let call = sample
            .trim_start_matches("Let me check.\n")
            .trim_start_matches("<|python_tag|>");
        let mut t = tools(parser);
        t.choice = Choice::Named("get_weather".into());
        for special in [true, false] {
            let lookup = |m: &str| {
                MARKERS
                    .iter()
                    .position(|k| *k == m)
                    .filter(|_| special)
                    .map(|i| 256 + i as u32)
            };
            let Some(Constraint::Lark(g)) = t.constraint(&lookup).expect("a grammar") else {
                panic!("{parser}: no grammar");
            };
            let mut m = byte_matcher(&g);
            m.consume_tokens(&byte_tokens(call, special))
                .unwrap_or_else(|e| panic!("{parser} (special {special}): {e}\n{g}"));
            assert!(
                m.is_accepting().expect("matcher"),
                "{parser}: the call does not complete the grammar\n{g}"
            );
            // Another tool's name, or arguments against the schema, are refused.
            for wrong in [
                call.replace("get_weather", "get_westher"),
                call.replace("\"Paris\"", "3"),
            ] {
                let mut m = byte_matcher(&g);
                let tokens = byte_tokens(&wrong, special);
                let taken = m.validate_tokens(&tokens).expect("matcher");
                assert!(taken < tokens.len(), "{parser}: accepted {wrong:?}");
            }
        }
        let (_, calls) = parse_complete(&t, call);
        assert_eq!(calls.len(), 1, "{parser}: {call:?} does not parse");
    }
}

#[test]
fn required_with_parallel_calls_repeats_the_call_and_auto_forces_nothing() {
    let mut t = tools("kimik2");
    t.choice = Choice::Required;
    let none = |_: &str| None;
    let Some(Constraint::Lark(g)) = t.constraint(&none).expect("a grammar") else {
        panic!("no grammar");
    };
    let one = "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|>";
    let two = format!(
        "<|tool_calls_section_begin|>{one}{}<|tool_calls_section_end|>",
        one.replace(":0", ":1")
    );
    let mut m = byte_matcher(&g);
    m.consume_tokens(&byte_tokens(&two, false))
        .unwrap_or_else(|e| panic!("{e}\n{g}"));
    assert!(m.is_accepting().expect("matcher"));
    t.parallel = false;
    let Some(Constraint::Lark(g)) = t.constraint(&none).expect("a grammar") else {
        panic!("no grammar");
    };
    let mut m = byte_matcher(&g);
    let tokens = byte_tokens(&two, false);
    assert!(m.validate_tokens(&tokens).expect("matcher") < tokens.len());
    t.choice = Choice::Auto;
    assert_eq!(t.constraint(&none).expect("auto"), None);
}

#[test]
fn a_bare_qwen_call_is_a_call_whole_and_streamed() {
    // Qwen2.5-Coder-0.5B's own greedy replies to weather questions (kiln and transformers agree
    // token for token on this model), bare and fenced.
    let bare =
        "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}";
    let fenced = "```json\n{\n  \"name\": \"get_weather\",\n  \"arguments\": {\n    \"city\": \"Tokyo\"\n  }\n}\n```";
    for text in [bare, fenced] {
        let (content, calls) = parse_complete(&tools("qwen"), text);
        assert_eq!(content, None, "{text}");
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        let mut s = StreamCalls::new(&tools("qwen")).expect("parser");
        let pieces = pieces_as_streamed(text);
        let mut got = Vec::new();
        let mut streamed = String::new();
        for (i, p) in pieces.iter().enumerate() {
            let (c, d) = s.feed(p, i + 1 == pieces.len());
            streamed.push_str(&c);
            got.extend(d);
        }
        assert!(streamed.is_empty(), "{streamed:?}");
        assert_eq!(got[0]["function"]["name"], "get_weather");
        assert_eq!(arguments(&got[1]), arguments(&calls[0]));
    }
    // JSON that names no requested tool, or text around it, is content.
    for text in [
        "{\"name\": \"Ada\", \"arguments\": {}}",
        "Here: {\"name\": \"get_weather\", \"arguments\": {}}",
    ] {
        let (content, calls) = parse_complete(&tools("qwen"), text);
        assert!(calls.is_empty(), "{text}");
        assert_eq!(content.as_deref(), Some(text));
        let mut s = StreamCalls::new(&tools("qwen")).expect("parser");
        let pieces = pieces_as_streamed(text);
        let mut streamed = String::new();
        for (i, p) in pieces.iter().enumerate() {
            let (c, d) = s.feed(p, i + 1 == pieces.len());
            assert!(d.is_empty());
            streamed.push_str(&c);
        }
        assert_eq!(streamed, text);
    }
}

#[test]
fn a_fenced_reply_in_another_language_streams_at_once() {
    let text = "```python\nprint('hello')\nprint('again')\n```";
    let mut s = StreamCalls::new(&tools("qwen")).expect("parser");
    let pieces = pieces_as_streamed(text);
    let mut before_last = String::new();
    let mut all = String::new();
    for (i, p) in pieces.iter().enumerate() {
        let last = i + 1 == pieces.len();
        let (c, d) = s.feed(p, last);
        assert!(d.is_empty());
        if !last {
            before_last.push_str(&c);
        }
        all.push_str(&c);
    }
    assert_eq!(all, text);
    assert!(
        before_last.contains("print('hello')"),
        "held to the end: {before_last:?}"
    );
    assert!(!could_be_bare("```py") && could_be_bare("```") && could_be_bare("```jso"));
}
