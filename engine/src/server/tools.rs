//! Tool calling on the wire: which format the model writes its calls in (`--tool-call-parser`, or
//! the chat template's markers), the request's tools and `tool_choice`, the grammar that forces a
//! call, and the model's text turned back into OpenAI `tool_calls` — whole, or as stream deltas.
//! The parsing itself is the `tool-parser` crate (SGLang's Rust gateway).

use std::sync::OnceLock;

use serde_json::{Value, json};
use tool_parser::ToolParser;

use super::error::ApiError;
use super::protocol::{ChatRequest, ToolChoice, ToolDef};
use crate::structured::Constraint;

/// SGLang's `--tool-call-parser` names (and vLLM's `hermes`), with `tool-parser`'s for each.
const FORMATS: &[(&str, &str)] = &[
    ("qwen25", "qwen"),
    ("qwen", "qwen"),
    ("hermes", "qwen"),
    ("llama3", "llama"),
    ("mistral", "mistral"),
    ("deepseekv3", "deepseek"),
    ("deepseekv31", "deepseek31"),
    ("kimi_k2", "kimik2"),
];

/// The parser for `--tool-call-parser NAME`, or the one the chat template's markers point to.
pub fn resolve(flag: Option<&str>, template: Option<&str>) -> Result<Option<&'static str>, String> {
    if let Some(name) = flag {
        return FORMATS
            .iter()
            .find(|(sglang, _)| *sglang == name)
            .map(|(_, parser)| Some(*parser))
            .ok_or_else(|| {
                let known: Vec<&str> = FORMATS.iter().map(|(n, _)| *n).collect();
                format!(
                    "--tool-call-parser `{name}` is not known (known: {})",
                    known.join(", ")
                )
            });
    }
    Ok(template.and_then(detect))
}

/// The tool-call format a chat template teaches its model, from the markers it writes.
fn detect(template: &str) -> Option<&'static str> {
    if template.contains("<|tool_calls_section_begin|>") {
        Some("kimik2")
    } else if template.contains("tool▁calls▁begin") {
        // V3 writes `function<｜tool▁sep｜>NAME` and a fenced JSON block; V3.1 drops both.
        if template.contains("function<｜tool▁sep｜>") || template.contains("```json") {
            Some("deepseek")
        } else {
            Some("deepseek31")
        }
    } else if template.contains("<tool_call>") {
        Some("qwen")
    } else if template.contains("[TOOL_CALLS]") {
        Some("mistral")
    } else if template.contains("<|python_tag|>") {
        Some("llama")
    } else {
        None
    }
}

/// What `tool_choice` asks.
#[derive(Clone, Debug, PartialEq)]
pub enum Choice {
    None,
    Auto,
    Required,
    Named(String),
}

/// A chat request's tools, checked.
#[derive(Clone, Debug)]
pub struct Tools {
    pub defs: Vec<ToolDef>,
    pub choice: Choice,
    pub parallel: bool,
    /// The `tool-parser` name of the model's format.
    pub parser: &'static str,
}

impl Tools {
    /// The request's tools, or `None` when it sends none. Problems are 400s naming the field.
    pub fn of(req: &ChatRequest, parser: Option<&'static str>) -> Result<Option<Tools>, ApiError> {
        let defs = req.tools.clone().unwrap_or_default();
        let choice = match &req.tool_choice {
            None => Choice::Auto,
            Some(ToolChoice::Mode(m)) => match m.as_str() {
                "none" => Choice::None,
                "auto" => Choice::Auto,
                "required" => Choice::Required,
                other => {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        format!(
                            "`tool_choice` `{other}` is not one of none, auto, required, or \
                             {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"
                        ),
                    ));
                }
            },
            Some(ToolChoice::Named(n)) => Choice::Named(n.function.name.clone()),
        };
        if defs.is_empty() {
            // No tools: nothing to render or parse, unless a choice was asked of none.
            return match choice {
                Choice::None => Ok(None),
                Choice::Auto if req.tool_choice.is_none() => Ok(None),
                _ => Err(ApiError::invalid(
                    "tool_choice",
                    "`tool_choice` needs `tools` to choose from",
                )),
            };
        }
        for (i, t) in defs.iter().enumerate() {
            if t.kind != "function" {
                return Err(ApiError::invalid(
                    format!("tools[{i}].type"),
                    format!("tool type `{}` is not supported; use `function`", t.kind),
                ));
            }
            if t.function.name.is_empty() {
                return Err(ApiError::invalid(
                    format!("tools[{i}].function.name"),
                    "a tool needs a name",
                ));
            }
            if let Some(p) = &t.function.parameters
                && !p.is_object()
            {
                return Err(ApiError::invalid(
                    format!("tools[{i}].function.parameters"),
                    "`parameters` must be a JSON schema object",
                ));
            }
        }
        if let Choice::Named(name) = &choice
            && !defs.iter().any(|t| &t.function.name == name)
        {
            return Err(ApiError::invalid(
                "tool_choice",
                format!("`tool_choice` names `{name}`, which is not among `tools`"),
            ));
        }
        // `none` renders the tools and parses nothing, so it needs no known format ("" then).
        let parser = parser
            .or((choice == Choice::None).then_some(""))
            .ok_or_else(|| {
                ApiError::invalid(
                    "tools",
                    "this model's chat template shows no tool-call format kiln knows; start kiln \
                 with --tool-call-parser (qwen25, llama3, mistral, deepseekv3, deepseekv31, \
                 kimi_k2)",
                )
            })?;
        Ok(Some(Tools {
            defs,
            choice,
            parallel: req.parallel_tool_calls.unwrap_or(true),
            parser,
        }))
    }

    /// The definitions as the chat template's `tools` reads them.
    pub fn template_values(&self) -> Vec<Value> {
        self.defs
            .iter()
            .map(|t| serde_json::to_value(t).unwrap_or(Value::Null))
            .collect()
    }

    /// Whether the output is parsed for calls (`none` leaves it as text).
    pub fn parses(&self) -> bool {
        self.choice != Choice::None
    }

    /// `required` and a named function force the output into calls of the given tools: a
    /// grammar in the model's own format, each call's arguments held to the tool's schema.
    /// `special` gives the id of a marker the vocabulary holds as a special token, which the
    /// grammar names by id (the model writes it as one token, and spelling it out would not
    /// produce it).
    pub fn constraint(
        &self,
        special: &dyn Fn(&str) -> Option<u32>,
    ) -> Result<Option<Constraint>, ApiError> {
        let tools: Vec<&ToolDef> = match &self.choice {
            Choice::None | Choice::Auto => return Ok(None),
            Choice::Required => self.defs.iter().collect(),
            Choice::Named(n) => self.defs.iter().filter(|t| &t.function.name == n).collect(),
        };
        let Some(f) = call_format(self.parser) else {
            return Err(ApiError::invalid(
                "tool_choice",
                format!(
                    "`tool_choice` `required` or a named function cannot force the `{}` tool \
                     format; use `auto`",
                    self.parser
                ),
            ));
        };
        let lit = |segments: &[&str]| -> String {
            let parts: Vec<String> = segments
                .iter()
                .map(|s| match special(s) {
                    Some(id) => format!("<[{id}]>"),
                    None => lark_string(s),
                })
                .collect();
            parts.join(" ")
        };
        // A rule's pieces, the empty ones left out.
        let seq = |pieces: &[&str]| -> String {
            pieces
                .iter()
                .filter(|p| !p.is_empty())
                .copied()
                .collect::<Vec<_>>()
                .join(" ")
        };
        let mut rules = Vec::new();
        let mut alternatives = Vec::new();
        for (i, t) in tools.iter().enumerate() {
            let name = &t.function.name;
            let name = if f.name_json {
                serde_json::to_string(name).unwrap_or_default()
            } else {
                name.clone()
            };
            // Compact JSON, as for response formats: free whitespace lets a small model pad the
            // arguments until max_tokens.
            let schema = crate::structured::compact(
                t.function
                    .parameters
                    .clone()
                    .unwrap_or_else(|| json!({"type": "object"})),
            );
            let body = seq(&[
                &lit(f.before_name),
                &lark_string(&name),
                &lit(f.after_name),
                if f.indexed { "INDEX" } else { "" },
                &lit(f.before_args),
                &format!("args_{i}"),
                &lit(f.after_args),
            ]);
            rules.push(format!("call_{i}: {body}\nargs_{i}: %json {schema}"));
            alternatives.push(format!("call_{i}"));
        }
        // One call, or (parallel, `required`) several.
        let more = if self.parallel && self.choice == Choice::Required {
            format!("({})*", seq(&[&lit(f.separator), "call"]))
        } else {
            String::new()
        };
        let index = if f.indexed { "INDEX: /[0-9]+/\n" } else { "" };
        let grammar = format!(
            "start: {}\ncall: {}\n{}\n{index}",
            seq(&[&lit(f.open), "call", &more, &lit(f.close)]),
            alternatives.join(" | "),
            rules.join("\n"),
        );
        Ok(Some(Constraint::Lark(grammar)))
    }

    /// Whether the reply's text keeps special tokens: a format's markers may be special tokens,
    /// and the parser reads them (as vLLM and SGLang keep them when tools are parsed).
    pub fn keeps_special(&self) -> bool {
        self.parses()
    }

    /// The OpenAI tool definitions `tool-parser` takes.
    fn protocol_tools(&self) -> Vec<openai_protocol::common::Tool> {
        self.defs
            .iter()
            .filter_map(|t| serde_json::to_value(t).ok())
            .filter_map(|v| serde_json::from_value(v).ok())
            .collect()
    }
}

/// How a format writes its calls, as the segments of text around each one; a segment that is a
/// special token in the vocabulary is named by id in the grammar.
struct CallFormat {
    /// Before the first call.
    open: &'static [&'static str],
    /// After the last call.
    close: &'static [&'static str],
    /// Between two calls.
    separator: &'static [&'static str],
    before_name: &'static [&'static str],
    /// The name is a JSON string (JSON formats) rather than bare text.
    name_json: bool,
    after_name: &'static [&'static str],
    /// The call's index follows (Kimi-K2's `functions.NAME:IDX`).
    indexed: bool,
    before_args: &'static [&'static str],
    after_args: &'static [&'static str],
}

/// The call layout of each `tool-parser` format, as its parser reads it and the family's chat
/// template writes it.
fn call_format(parser: &str) -> Option<CallFormat> {
    const NONE: &[&str] = &[];
    Some(match parser {
        // `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`, a line apart.
        "qwen" => CallFormat {
            open: NONE,
            close: NONE,
            separator: &["\n"],
            before_name: &["<tool_call>", "\n{\"name\": "],
            name_json: true,
            after_name: &[", \"arguments\": "],
            indexed: false,
            before_args: NONE,
            after_args: &["}\n", "</tool_call>"],
        },
        // `{"name": ..., "parameters": ...}`, `; ` apart.
        "llama" => CallFormat {
            open: NONE,
            close: NONE,
            separator: &["; "],
            before_name: &["{\"name\": "],
            name_json: true,
            after_name: &[", \"parameters\": "],
            indexed: false,
            before_args: NONE,
            after_args: &["}"],
        },
        // `[TOOL_CALLS] [{"name": ..., "arguments": ...}, ...]`.
        "mistral" => CallFormat {
            open: &["[TOOL_CALLS]", " ["],
            close: &["]"],
            separator: &[", "],
            before_name: &["{\"name\": "],
            name_json: true,
            after_name: &[", \"arguments\": "],
            indexed: false,
            before_args: NONE,
            after_args: &["}"],
        },
        // `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜>`.
        "deepseek" => CallFormat {
            open: &["<｜tool▁calls▁begin｜>"],
            close: &["<｜tool▁calls▁end｜>"],
            separator: &["\n"],
            before_name: &["<｜tool▁call▁begin｜>", "function", "<｜tool▁sep｜>"],
            name_json: false,
            after_name: &["\n```json\n"],
            indexed: false,
            before_args: NONE,
            after_args: &["\n```", "<｜tool▁call▁end｜>"],
        },
        // `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`.
        "deepseek31" => CallFormat {
            open: &["<｜tool▁calls▁begin｜>"],
            close: &["<｜tool▁calls▁end｜>"],
            separator: NONE,
            before_name: &["<｜tool▁call▁begin｜>"],
            name_json: false,
            after_name: &["<｜tool▁sep｜>"],
            indexed: false,
            before_args: NONE,
            after_args: &["<｜tool▁call▁end｜>"],
        },
        // `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>`.
        "kimik2" => CallFormat {
            open: &["<|tool_calls_section_begin|>"],
            close: &["<|tool_calls_section_end|>"],
            separator: NONE,
            before_name: &["<|tool_call_begin|>", "functions."],
            name_json: false,
            after_name: &[":"],
            indexed: true,
            before_args: &["<|tool_call_argument_begin|>"],
            after_args: &["<|tool_call_end|>"],
        },
        _ => return None,
    })
}

/// `s` as a Lark string literal.
fn lark_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

fn factory() -> &'static tool_parser::ParserFactory {
    static FACTORY: OnceLock<tool_parser::ParserFactory> = OnceLock::new();
    FACTORY.get_or_init(tool_parser::ParserFactory::new)
}

fn parser_for(name: &str) -> Option<Box<dyn ToolParser>> {
    factory().registry().create_parser(name)
}

/// A call's id: Kimi-K2 names its calls `functions.NAME:INDEX` (and reads them back so in the
/// history); the others get OpenAI-style random ids.
fn call_id(parser: &str, name: &str, index: usize) -> String {
    if parser == "kimik2" {
        return format!("functions.{name}:{index}");
    }
    use rand::Rng;
    let mut rng = rand::rng();
    let tail: String = (0..24)
        .map(|_| char::from(b"abcdefghijklmnopqrstuvwxyz0123456789"[rng.random_range(0..36)]))
        .collect();
    format!("call_{tail}")
}

/// The model's whole text split into its content and its calls (none: all of it is content;
/// text that does not parse stays content, never an error).
pub fn parse_complete(tools: &Tools, text: &str) -> (Option<String>, Vec<Value>) {
    let Some(parser) = parser_for(tools.parser) else {
        return (Some(text.to_string()), Vec::new());
    };
    let proto = tools.protocol_tools();
    let parsed = futures::executor::block_on(parser.parse_complete_with_tools(text, &proto));
    if !matches!(&parsed, Ok((_, calls)) if !calls.is_empty())
        && let Some(calls) = bare_calls(tools, text)
    {
        let calls = calls
            .into_iter()
            .enumerate()
            .map(|(i, (name, arguments))| {
                json!({"id": call_id(tools.parser, &name, i), "type": "function",
                       "function": {"name": name, "arguments": arguments}})
            })
            .collect();
        return (None, calls);
    }
    match parsed {
        Ok((rest, calls)) if !calls.is_empty() => {
            let calls = calls
                .into_iter()
                .enumerate()
                .map(|(i, c)| {
                    json!({"id": call_id(tools.parser, &c.function.name, i), "type": "function",
                           "function": {"name": c.function.name, "arguments": c.function.arguments}})
                })
                .collect();
            let rest = rest.trim();
            ((!rest.is_empty()).then(|| rest.to_string()), calls)
        }
        _ => (Some(text.to_string()), Vec::new()),
    }
}

/// Calls written without the format's markers: the whole reply one JSON object (or a list of
/// them), bare or in a ```json fence, each naming a requested tool and carrying its arguments.
/// Qwen2.5's small models write calls so more often than in `<tool_call>` tags (Qwen2.5-Coder-0.5B
/// does, greedy, on every weather prompt tried); a reply that is anything more is content.
fn bare_calls(tools: &Tools, text: &str) -> Option<Vec<(String, String)>> {
    if tools.parser != "qwen" {
        return None;
    }
    let mut t = text.trim();
    if let Some(inner) = t.strip_prefix("```json").or_else(|| t.strip_prefix("```")) {
        t = inner.strip_suffix("```")?.trim();
    }
    let items = match serde_json::from_str::<Value>(t).ok()? {
        Value::Array(items) => items,
        one @ Value::Object(_) => vec![one],
        _ => return None,
    };
    items
        .iter()
        .map(|item| {
            let name = item.get("name")?.as_str()?;
            tools.defs.iter().find(|d| d.function.name == name)?;
            let args = item.get("arguments").or_else(|| item.get("parameters"))?;
            args.is_object()
                .then(|| (name.to_string(), args.to_string()))
        })
        .collect::<Option<Vec<_>>>()
        .filter(|calls| !calls.is_empty())
}

/// Whether a reply that begins so may still turn out one bare call: an object, or a fence whose
/// first line says json (or nothing) — a ```` ```python ```` block is released at once.
fn could_be_bare(start: &str) -> bool {
    if start.starts_with('{') {
        return true;
    }
    let Some(rest) = start.strip_prefix("```") else {
        return false;
    };
    match rest.find('\n') {
        None => "json".starts_with(rest.trim()),
        Some(end) => matches!(rest[..end].trim(), "" | "json"),
    }
}

/// One streamed choice's parser: text in, content and tool-call deltas out.
pub struct StreamCalls {
    tools: Tools,
    /// A reply that so far could be one bare call (see `bare_calls`), held until it ends.
    bare: Option<String>,
    /// Nothing has been sent yet (a bare call must be the whole reply).
    fresh: bool,
    parser: Box<dyn ToolParser>,
    proto: Vec<openai_protocol::common::Tool>,
    format: &'static str,
    /// Each started call's name, by its index.
    names: Vec<String>,
    /// Formats whose incremental parser leaks markers into the arguments (DeepSeek-V3's fenced
    /// JSON: `tool-parser` 1.10 streams the closing fence and end markers as arguments) are held
    /// from their first call marker and parsed whole at the end: the calls still arrive as id
    /// and name first, then the arguments, only not fragment by fragment.
    held: Option<String>,
}

/// Where a held format's calls begin.
fn hold_marker(format: &str) -> Option<&'static str> {
    (format == "deepseek").then_some("<｜tool▁calls▁begin｜>")
}

impl StreamCalls {
    pub fn new(tools: &Tools) -> Option<StreamCalls> {
        Some(StreamCalls {
            tools: tools.clone(),
            bare: None,
            fresh: true,
            parser: parser_for(tools.parser)?,
            proto: tools.protocol_tools(),
            format: tools.parser,
            names: Vec::new(),
            held: None,
        })
    }

    /// Whether a call has started.
    pub fn called(&self) -> bool {
        !self.names.is_empty()
    }

    /// The content and the `tool_calls` deltas a piece of text makes; `last` flushes what the
    /// parser still holds.
    pub fn feed(&mut self, text: &str, last: bool) -> (String, Vec<Value>) {
        if let Some(marker) = hold_marker(self.format) {
            return self.feed_held(marker, text, last);
        }
        if let Some(out) = self.feed_bare(text, last) {
            return out;
        }
        let mut content = String::new();
        let mut deltas = Vec::new();
        if !text.is_empty() {
            match futures::executor::block_on(self.parser.parse_incremental(text, &self.proto)) {
                Ok(r) => {
                    content.push_str(&r.normal_text);
                    for item in r.calls {
                        deltas.push(self.delta(item.tool_index, item.name, item.parameters));
                    }
                }
                // The parser gave up: what it held and this piece are the model's answer.
                Err(_) => {
                    content.push_str(&self.parser.take_unstreamed_normal_text());
                    content.push_str(text);
                }
            }
        }
        if last {
            for item in self.parser.get_unstreamed_tool_args().unwrap_or_default() {
                deltas.push(self.delta(item.tool_index, item.name, item.parameters));
            }
            content.push_str(&self.parser.take_unstreamed_normal_text());
        }
        (content, deltas)
    }

    /// A reply that opens like a bare call (`{` or a fence, first thing) is held to its end and
    /// then sent as calls or, if it is not one, as content; `None`: not held, parse as usual.
    fn feed_bare(&mut self, text: &str, last: bool) -> Option<(String, Vec<Value>)> {
        if self.tools.parser != "qwen" {
            return None;
        }
        match &mut self.bare {
            Some(held) => held.push_str(text),
            None if self.fresh => {
                let start = text.trim_start();
                if start.is_empty() && !last {
                    // Leading whitespace: decide on the next piece.
                    self.bare = Some(text.to_string());
                    return Some((String::new(), Vec::new()));
                }
                if !(start.starts_with('{') || start.starts_with("```")) {
                    self.fresh = false;
                    return None;
                }
                self.bare = Some(text.to_string());
            }
            None => return None,
        }
        let held = self.bare.as_deref().unwrap_or_default();
        let trimmed = held.trim_start();
        if !(trimmed.is_empty() || could_be_bare(trimmed)) {
            // Only whitespace was held, then text: parse it all as usual.
            let held = self.bare.take().unwrap_or_default();
            self.fresh = false;
            return Some(self.feed(&held, last));
        }
        if !last {
            return Some((String::new(), Vec::new()));
        }
        let held = self.bare.take().unwrap_or_default();
        self.fresh = false;
        match bare_calls(&self.tools, &held) {
            Some(calls) => {
                let mut deltas = Vec::new();
                for (i, (name, arguments)) in calls.into_iter().enumerate() {
                    deltas.push(self.delta(i, Some(name), String::new()));
                    deltas.push(self.delta(i, None, arguments));
                }
                Some((String::new(), deltas))
            }
            None => Some(self.feed(&held, true)),
        }
    }

    /// A held format: text before the first call marker is content; from it on the text is
    /// kept, and parsed whole when the reply ends.
    fn feed_held(&mut self, marker: &str, text: &str, last: bool) -> (String, Vec<Value>) {
        let mut content = String::new();
        match &mut self.held {
            Some(held) => held.push_str(text),
            None => match text.find(marker) {
                Some(at) => {
                    content.push_str(&text[..at]);
                    self.held = Some(text[at..].to_string());
                }
                None => content.push_str(text),
            },
        }
        let mut deltas = Vec::new();
        if last && let Some(held) = self.held.take() {
            let proto = self.proto.clone();
            match futures::executor::block_on(self.parser.parse_complete_with_tools(&held, &proto))
            {
                Ok((rest, calls)) if !calls.is_empty() => {
                    for (i, c) in calls.into_iter().enumerate() {
                        deltas.push(self.delta(i, Some(c.function.name), String::new()));
                        deltas.push(self.delta(i, None, c.function.arguments));
                    }
                    content.push_str(rest.trim());
                }
                // Not a call after all: the text is the model's answer.
                _ => content.push_str(&held),
            }
        }
        (content, deltas)
    }

    fn delta(&mut self, index: usize, name: Option<String>, arguments: String) -> Value {
        match name {
            Some(name) => {
                let id = call_id(self.format, &name, index);
                if self.names.len() <= index {
                    self.names.resize(index + 1, String::new());
                }
                self.names[index] = name.clone();
                json!({"index": index, "id": id, "type": "function",
                       "function": {"name": name, "arguments": arguments}})
            }
            None => json!({"index": index, "function": {"arguments": arguments}}),
        }
    }
}

#[cfg(test)]
mod tests;
