//! Structured outputs (llguidance over kiln's own token table) and tool calls through the real
//! server: the official `openai` client's `parse` with pydantic models, `json_object`, vLLM's
//! regex and choice fields (`tests/clients/structured_client.py`); tool calls on Qwen2.5-Coder,
//! forced, streamed, written freely under `auto` (`tests/clients/tools_client.py`); a guided
//! request among unguided ones at C = 16 answers as it does alone; `null` for an optional field
//! means its default.

mod common;

use common::server::Server;
use serde_json::{Value, json};

#[test]
fn the_token_table_spells_every_token_of_real_text() {
    let tok = common::smollm2_tokenizer();
    let table = tok.token_bytes();
    assert_eq!(table.len(), tok.vocab_size());
    for text in [
        "def add(a, b):\n    return a + b\n",
        "{\"name\": \"Zoë\", \"age\": 7}",
        "naïve café — 東京 🙂\t\r\n",
    ] {
        let ids = tok.encode(text, false).expect("encode");
        let spelled: Vec<u8> = ids
            .iter()
            .flat_map(|&i| table[i as usize].clone())
            .collect();
        assert_eq!(String::from_utf8_lossy(&spelled), text);
    }
    // Special tokens carry the marker, so no grammar spells them by accident.
    let im_end = tok.encode("<|im_end|>", false).expect("encode");
    assert_eq!(im_end.len(), 1);
    assert_eq!(table[im_end[0] as usize][0], 0xFF);
}

#[test]
fn a_draft_path_through_the_end_token_leaves_the_matcher_where_it_was() {
    // Mid-number, the grammar may end: llguidance takes an end token there without recording it,
    // so a path through one must never reach the matcher (its rollback would undo a real token).
    let tok = common::smollm2_tokenizer();
    let grammars = kiln::structured::Grammars::new(&tok, tok.vocab_size()).expect("token table");
    let mut guide = grammars
        .guide(&kiln::structured::Constraint::Regex("[0-9]+".into()))
        .expect("regex");
    let digit = |d: &str| tok.encode(d, false).expect("encode")[0];
    guide.advance(digit("1"));
    let before = guide.mask();
    let eos = tok.eos_ids[0];
    assert!(before.allows(eos) && before.allows(digit("2")));
    let after_eos = guide.mask_after(&[digit("2"), eos]);
    assert!((0..tok.vocab_size() as u32).all(|t| !after_eos.allows(t)));
    assert_eq!(guide.mask(), before, "the matcher moved");
    assert_eq!(guide.admits(&[digit("2"), eos, digit("3")]), 2);
    guide.advance(digit("2"));
    assert_eq!(guide.error(), None);
    guide.advance(eos);
    assert!(guide.finished());
}

#[test]
fn the_official_client_parses_pydantic_models_and_regexes() {
    let s = Server::start(&["--served-model-name", "m"]);
    s.run_client("structured_client.py", &[]);
}

#[test]
fn the_official_client_calls_tools_on_qwen() {
    let port = common::server::free_port();
    let model = common::qwen();
    let (port_text, model) = (port.to_string(), model.to_string_lossy().to_string());
    let s = Server::start_exactly(
        port,
        &[
            "--port",
            &port_text,
            "--model",
            &model,
            "--threads",
            "1",
            "--kv-tokens",
            "8192",
        ],
    );
    s.run_client("tools_client.py", &[]);
}

/// Qwen2.5-Coder on its own port, with `extra` flags.
fn qwen_server(extra: &[&str]) -> Server {
    let port = common::server::free_port();
    let (port_text, model) = (
        port.to_string(),
        common::qwen().to_string_lossy().to_string(),
    );
    let mut args = vec![
        "--port",
        &port_text,
        "--model",
        &model,
        "--served-model-name",
        "m",
        "--kv-tokens",
        "4096",
    ];
    args.extend_from_slice(extra);
    Server::start_exactly(port, &args)
}

#[test]
fn a_forced_call_in_every_tool_format_comes_back_as_that_call() {
    // The grammar writes Qwen2.5-Coder's call in each family's format, and that family's parser
    // reads it back, for a named function (and `required` in two of them).
    let weather = json!([{"type": "function", "function": {"name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
        {"type": "function", "function": {"name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                       "required": ["zone"]}}}]);
    for (flag, id) in [
        ("qwen25", "call_"),
        ("llama3", "call_"),
        ("mistral", "call_"),
        ("deepseekv3", "call_"),
        ("deepseekv31", "call_"),
        ("kimi_k2", "functions.get_weather:"),
    ] {
        let s = qwen_server(&["--tool-call-parser", flag]);
        // `required` builds the same rule over every tool: two formats cover it.
        let mut choices = vec![json!({"type": "function", "function": {"name": "get_weather"}})];
        if ["qwen25", "kimi_k2"].contains(&flag) {
            choices.push(json!("required"));
        }
        for choice in choices {
            // Markers Qwen's vocabulary lacks are spelled in pieces: room for them.
            let body = json!({"model": "m", "max_tokens": 200, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                "tools": weather, "tool_choice": choice,
                // One call, so the reply ends by itself (the grammar repeats parallel calls).
                "parallel_tool_calls": false});
            let v = chat(&s, &body);
            let c = &v["choices"][0];
            assert_eq!(c["finish_reason"], "tool_calls", "{flag} {choice}: {v}");
            let call = &c["message"]["tool_calls"][0];
            assert!(
                call["id"].as_str().is_some_and(|i| i.starts_with(id)),
                "{flag}: {v}"
            );
            let args = call["function"]["arguments"].as_str().expect("arguments");
            let args: Value = serde_json::from_str(args).unwrap_or_else(|e| panic!("{e}: {v}"));
            if call["function"]["name"] == "get_weather" {
                assert!(args["city"].is_string(), "{flag}: {v}");
            } else {
                assert_eq!(call["function"]["name"], "get_time", "{flag}: {v}");
                assert!(args["zone"].is_string(), "{flag}: {v}");
            }
            assert!(
                c["message"]["content"].is_null() || c["message"]["content"].as_str() == Some(""),
                "{flag}: the call's text leaked into content: {v}"
            );
        }
    }
}

fn chat(s: &Server, body: &Value) -> Value {
    let (status, v) = s.post_json("/v1/chat/completions", body);
    assert_eq!(status, 200, "{v}");
    v
}

#[test]
fn a_guided_request_in_a_batch_of_16_answers_as_it_does_alone() {
    let s = Server::start(&["--served-model-name", "m"]);
    let schema = json!({"type": "object", "properties": {
        "city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"], "additionalProperties": false});
    let guided = |q: usize| {
        json!({"model": "m", "max_tokens": 48, "temperature": 0,
               "messages": [{"role": "user", "content": format!("Name city number {q} as JSON.")}],
               "response_format": {"type": "json_schema",
                                   "json_schema": {"name": "city", "schema": schema, "strict": true}}})
    };
    let plain = |q: usize| {
        json!({"model": "m", "max_tokens": 48, "temperature": 0, "ignore_eos": true,
               "messages": [{"role": "user", "content": format!("Tell me about city {q}.")}]})
    };
    let alone: Vec<Value> = (0..4).map(|q| chat(&s, &guided(q))).collect();
    let together: Vec<Value> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..16)
            .map(|q| {
                let body = if q % 4 == 0 { guided(q / 4) } else { plain(q) };
                let s = &s;
                scope.spawn(move || chat(s, &body))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("client"))
            .collect()
    });
    for (q, want) in alone.iter().enumerate() {
        let got = &together[q * 4];
        assert_eq!(
            got["choices"][0]["message"], want["choices"][0]["message"],
            "question {q}"
        );
        let choice = &want["choices"][0];
        if choice["finish_reason"] == "stop" {
            let text = choice["message"]["content"].as_str().expect("content");
            let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert!(v["city"].is_string() && v["population"].is_i64(), "{v}");
            assert_eq!(v.as_object().map(|o| o.len()), Some(2), "{v}");
        }
    }
    // Unguided requests in that batch were not masked.
    assert!(together.iter().enumerate().any(|(i, v)| {
        i % 4 != 0
            && !v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or("")
                .starts_with('{')
    }));
}

#[test]
fn bad_constraints_are_400s_naming_their_field_and_null_means_default() {
    let s = Server::start(&["--served-model-name", "m"]);
    let ask = json!([{"role": "user", "content": "hi"}]);
    for (field, value, param) in [
        ("guided_regex", json!("(unclosed"), "guided_regex"),
        (
            "guided_grammar",
            json!("start: missing_rule"),
            "guided_grammar",
        ),
        ("guided_json", json!({"type": "objekt"}), "guided_json"),
        ("ebnf", json!("root ::= \"a\""), "ebnf"),
    ] {
        let mut body = json!({"messages": ask, "max_tokens": 4});
        body[field] = value;
        let (status, v) = s.post_json("/v1/chat/completions", &body);
        assert_eq!(status, 400, "{field}: {v}");
        assert_eq!(v["error"]["param"], param, "{v}");
    }
    // OpenAI's API reads null as "not given".
    let v = chat(
        &s,
        &json!({"messages": ask, "max_tokens": 3, "stream": null, "logprobs": null,
                "ignore_eos": null, "response_format": null, "stop": null, "n": null}),
    );
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let (status, v) = s.post_json(
        "/v1/completions",
        &json!({"prompt": "Hello", "max_tokens": 3, "echo": null, "stream": null}),
    );
    assert_eq!(status, 200, "{v}");
}

#[test]
fn json_schema_requests_at_c16_with_ngram_chains_and_eagle3_trees_equal_plain_decoding() {
    // Every request is guided, so every draft is a guided sequence's: checked against its
    // grammar, verified under its row's mask, the matcher following only what stands. Every
    // reply must equal the server without speculation, with n-gram chains and with EAGLE-3
    // trees (a tree node the grammar refuses is never reached).
    let schema = json!({"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 40}, "tags": {"type": "array",
        "items": {"type": "string", "maxLength": 12}, "maxItems": 4}},
        "required": ["title", "tags"], "additionalProperties": false});
    let body = |q: usize| {
        json!({"model": "m", "max_tokens": 40, "temperature": 0,
            "messages": [{"role": "user", "content":
                format!("Write a title and tags for note {q}: repeat repeat repeat the words.")}],
            "response_format":
                {"type": "json_schema", "json_schema": {"name": "note", "schema": schema}}})
    };
    let run = |s: &Server| -> Vec<Value> {
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..16)
                .map(|q| {
                    let b = body(q);
                    scope.spawn(move || chat(s, &b)["choices"][0].clone())
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("client"))
                .collect()
        })
    };
    let plain = Server::start(&["--served-model-name", "m"]);
    let want = run(&plain);
    drop(plain);
    let spec = Server::start(&[
        "--served-model-name",
        "m",
        "--speculative-algorithm",
        "ngram",
        "--speculative-policy",
        "fixed",
    ]);
    let got = run(&spec);
    assert_eq!(got, want);
    // Every reply that ended by itself validates (one cut by max_tokens says `length`).
    for c in got.iter().filter(|c| c["finish_reason"] == "stop") {
        let text = c["message"]["content"].as_str().expect("content");
        let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(v["title"].is_string() && v["tags"].is_array(), "{v}");
    }
    assert!(
        got.iter().any(|c| c["finish_reason"] == "stop"),
        "no reply ended by itself"
    );
    let drafted = |s: &Server, what: &str| {
        assert!(
            s.metric("kiln_spec_draft_tokens_total") > 0.0,
            "{what}: guided sequences drafted nothing"
        );
        assert!(
            s.metric("kiln_spec_accepted_tokens_total") > 0.0,
            "{what}: no guided draft was accepted"
        );
    };
    drafted(&spec, "n-gram");
    drop(spec);

    // A small-vocabulary EAGLE-3 head drafting JSON's punctuation as a tree.
    let dir = common::small_vocab_draft("guided-tree", &[",", " ", "\"", ":", " \""]);
    let draft = dir.to_string_lossy().to_string();
    let mut flags = common::eagle3_tree_flags(&draft).to_vec();
    flags.extend(["--served-model-name", "m", "--speculative-policy", "fixed"]);
    let tree = Server::start(&flags);
    assert_eq!(run(&tree), want, "EAGLE-3 tree");
    drafted(&tree, "EAGLE-3 tree");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_reasoning_parser_moves_thinking_into_reasoning_content() {
    // DeepSeek-R1's parser reads a reply with no `</think>` as all reasoning (R1's template opens
    // the think block itself): SmolLM2's plain reply must land, whole and streamed, in
    // `reasoning_content`, equal to the plain server's `content`.
    let ask = json!({"model": "m", "max_tokens": 24, "temperature": 0, "ignore_eos": true,
                     "messages": [{"role": "user", "content": "Why is the sky blue?"}]});
    let plain = Server::start(&["--served-model-name", "m"]);
    let want = chat(&plain, &ask)["choices"][0]["message"]["content"].clone();
    drop(plain);
    let s = Server::start(&[
        "--served-model-name",
        "m",
        "--reasoning-parser",
        "deepseek-r1",
    ]);
    let got = chat(&s, &ask);
    let msg = &got["choices"][0]["message"];
    assert_eq!(msg["reasoning_content"], want, "{got}");
    assert_eq!(msg["content"], "", "{got}");
    let mut streamed = ask.clone();
    streamed["stream"] = json!(true);
    let (status, body) = s.request(
        "POST",
        "/v1/chat/completions",
        &["Content-Type: application/json"],
        streamed.to_string().as_bytes(),
    );
    assert_eq!(status, 200);
    let mut reasoning = String::new();
    for data in common::server::sse_data(&body) {
        if data == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(&data).expect("chunk");
        let delta = &v["choices"][0]["delta"];
        reasoning.push_str(delta["reasoning_content"].as_str().unwrap_or(""));
        assert!(delta["content"].as_str().unwrap_or("").is_empty(), "{v}");
    }
    assert_eq!(Value::String(reasoning), want);
    let (_, info) = s.request("GET", "/model_info", &[], b"");
    let info: Value = serde_json::from_str(&info).expect("model_info");
    assert_eq!(info["reasoning_parser"], "deepseek_r1");
}
