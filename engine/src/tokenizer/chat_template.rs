//! The model's own chat template (Jinja, from GGUF metadata or tokenizer_config.json), rendered with
//! minijinja configured like transformers' sandboxed Jinja environment.

use minijinja::{Environment, ErrorKind, context};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

pub struct ChatTemplate {
    env: Environment<'static>,
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
        env.add_template_owned(NAME, source.to_string())
            .map_err(|e| {
                Error::ChatTemplate(format!("the model's template does not parse: {e}"))
            })?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.unwrap_or_default(),
            eos_token: eos_token.unwrap_or_default(),
        })
    }

    /// The prompt text for `messages`; with `add_generation_prompt` it ends where the assistant's reply
    /// begins.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let tmpl = self
            .env
            .get_template(NAME)
            .map_err(|e| Error::ChatTemplate(e.to_string()))?;
        tmpl.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        })
        .map_err(|e| Error::ChatTemplate(format!("rendering failed: {e}")))
    }
}
