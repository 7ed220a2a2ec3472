//! The model's own chat template (Jinja, from GGUF metadata or tokenizer_config.json), rendered with
//! minijinja configured like transformers' sandboxed Jinja environment.

use minijinja::{Environment, ErrorKind, context};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Error, Result};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant turn's calls, as templates read them: `{"id", "type", "function": {"name",
    /// "arguments"}}` with the arguments as an object (transformers' convention).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<Value>>,
    /// A tool turn's answer to this call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }
}

pub struct ChatTemplate {
    env: Environment<'static>,
    /// The Jinja source (its markers name the model's tool-call format).
    source: String,
    bos_token: String,
    eos_token: String,
}

const NAME: &str = "chat";

fn raise_exception(msg: String) -> std::result::Result<String, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

impl ChatTemplate {
    pub fn new(
        source: &str,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        // transformers renders with trim_blocks and lstrip_blocks on.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        // transformers' `tojson` is Python's `json.dumps` (", " and ": ", no HTML escaping,
        // keys in their given order); minijinja's own writes compact, escaped JSON, which would
        // render tool definitions differently from the reference.
        env.add_filter("tojson", python_tojson);
        env.add_template_owned(NAME, source.to_string())
            .map_err(|e| {
                Error::ChatTemplate(format!("the model's template does not parse: {e}"))
            })?;
        Ok(ChatTemplate {
            env,
            source: source.to_string(),
            bos_token: bos_token.unwrap_or_default(),
            eos_token: eos_token.unwrap_or_default(),
        })
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// The prompt text for `messages`; with `add_generation_prompt` it ends where the assistant's reply
    /// begins.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// As [`ChatTemplate::render`], with the request's tool definitions (the template's `tools`).
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[Value]>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let tmpl = self
            .env
            .get_template(NAME)
            .map_err(|e| Error::ChatTemplate(e.to_string()))?;
        tmpl.render(context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        })
        .map_err(|e| Error::ChatTemplate(format!("rendering failed: {e}")))
    }
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=indent)`, as transformers' `tojson`.
fn python_tojson(
    value: minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<minijinja::Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let json = serde_json::to_value(&value)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    write_python_json(&json, indent, 0, &mut out);
    Ok(minijinja::Value::from_safe_string(out))
}

fn write_python_json(v: &Value, indent: Option<usize>, depth: usize, out: &mut String) {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v {
        Value::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_python_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        Value::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                out.push_str(&Value::String(k.clone()).to_string());
                out.push_str(": ");
                write_python_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}
