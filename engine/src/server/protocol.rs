//! OpenAI request bodies, parsed strictly: a wrong type or an unknown field is a 400 naming the
//! field. Validation against the model (context length, vocabulary) happens in `validate`.

use serde::Deserialize;

use super::error::ApiError;

/// Parses a JSON body, turning serde's error into a 400 that names the offending field.
pub fn parse_body<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    if bytes.iter().all(|b| b.is_ascii_whitespace()) {
        return Err(ApiError::bad_request(
            "The request body is empty; send a JSON object",
        ));
    }
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut *de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let msg = inner.to_string();
        if inner.is_syntax() || inner.is_eof() {
            return ApiError::bad_request(format!("The request body is not valid JSON: {msg}"));
        }
        // Unknown fields are reported at their parent; name the field itself.
        let param = match msg.strip_prefix("unknown field `") {
            Some(rest) => rest.split('`').next().unwrap_or_default().to_string(),
            None if path == "." => String::new(),
            None => path,
        };
        if param.is_empty() {
            ApiError::bad_request(format!("Invalid request: {msg}"))
        } else {
            ApiError::invalid(param.clone(), format!("Invalid `{param}`: {msg}"))
        }
    })?;
    // One JSON value and nothing after it but whitespace: a body with trailing bytes is not
    // the request the client thinks it sent.
    de.end().map_err(|e| {
        ApiError::bad_request(format!(
            "The request body has data after its JSON value: {e}"
        ))
    })?;
    Ok(value)
}

#[derive(Deserialize, Debug, Clone)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

#[derive(Deserialize, Debug, Clone)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

#[derive(Deserialize, Debug, Clone, Default)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    #[serde(default, deserialize_with = "null_default")]
    pub include_usage: bool,
}

/// Sampling and length fields shared by both endpoints.
#[derive(Debug, Clone, Default)]
pub struct Knobs {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub n: Option<i64>,
    pub ignore_eos: bool,
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
}

#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Prompt,
    pub max_tokens: Option<i64>,
    /// Number of top alternatives per token (0..=20).
    pub logprobs: Option<i64>,
    #[serde(default, deserialize_with = "null_default")]
    pub echo: bool,
    pub user: Option<String>,
    // Flattened fields cannot be combined with deny_unknown_fields, so the shared ones are listed.
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub n: Option<i64>,
    #[serde(default, deserialize_with = "null_default")]
    pub ignore_eos: bool,
    #[serde(default, deserialize_with = "null_default")]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    // Structured outputs: OpenAI's, then vLLM's and SGLang's names for the same constraints.
    pub response_format: Option<ResponseFormat>,
    pub guided_json: Option<serde_json::Value>,
    pub guided_regex: Option<String>,
    pub guided_grammar: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    pub structured_outputs: Option<StructuredOutputs>,
    pub regex: Option<String>,
    pub json_schema: Option<serde_json::Value>,
    pub ebnf: Option<String>,
}

#[derive(Deserialize, Debug, Clone)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct Message {
    pub role: String,
    pub content: Option<Content>,
    pub name: Option<String>,
    /// An assistant turn that called tools.
    pub tool_calls: Option<Vec<MessageToolCall>>,
    /// A tool turn: the call it answers.
    pub tool_call_id: Option<String>,
    /// An assistant turn's reasoning, as kiln returned it (templates may drop or render it).
    pub reasoning_content: Option<String>,
}

/// One call in an assistant message of the history.
#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct MessageToolCall {
    pub id: Option<String>,
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub function: CalledFunction,
    /// Streaming clients echo the delta's index back.
    pub index: Option<u32>,
}

#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct CalledFunction {
    pub name: String,
    /// JSON text, as OpenAI sends it (an object is taken too).
    pub arguments: serde_json::Value,
}

/// A tool the model may call: `{"type": "function", "function": {...}}`.
#[derive(Deserialize, serde::Serialize, Debug, Clone)]
pub struct ToolDef {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionDef,
}

#[derive(Deserialize, serde::Serialize, Debug, Clone)]
pub struct FunctionDef {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parameters: Option<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// `tool_choice`: `"none"`, `"auto"`, `"required"`, or one named function.
#[derive(Deserialize, Debug, Clone)]
#[serde(untagged)]
pub enum ToolChoice {
    Mode(String),
    Named(NamedToolChoice),
}

#[derive(Deserialize, Debug, Clone)]
pub struct NamedToolChoice {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: NamedFunction,
}

#[derive(Deserialize, Debug, Clone)]
pub struct NamedFunction {
    pub name: String,
}

#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Vec<Message>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub tools: Option<Vec<ToolDef>>,
    pub tool_choice: Option<ToolChoice>,
    pub parallel_tool_calls: Option<bool>,
    #[serde(default, deserialize_with = "null_default")]
    pub logprobs: bool,
    pub top_logprobs: Option<i64>,
    pub user: Option<String>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub n: Option<i64>,
    #[serde(default, deserialize_with = "null_default")]
    pub ignore_eos: bool,
    #[serde(default, deserialize_with = "null_default")]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    // Structured outputs: OpenAI's, then vLLM's and SGLang's names for the same constraints.
    pub response_format: Option<ResponseFormat>,
    pub guided_json: Option<serde_json::Value>,
    pub guided_regex: Option<String>,
    pub guided_grammar: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    pub structured_outputs: Option<StructuredOutputs>,
    pub regex: Option<String>,
    pub json_schema: Option<serde_json::Value>,
    pub ebnf: Option<String>,
}

/// The views both generation requests give of the fields they share. The fields are declared in
/// each struct, not in a flattened one, because serde's `flatten` does not combine with
/// `deny_unknown_fields` (an unknown field must stay a 400).
macro_rules! shared_views {
    ($($request:ty),*) => {$(
        impl $request {
            pub fn constraint_fields(&self) -> ConstraintFields<'_> {
                ConstraintFields {
                    response_format: self.response_format.as_ref(),
                    guided_json: self.guided_json.as_ref(),
                    guided_regex: self.guided_regex.as_deref(),
                    guided_grammar: self.guided_grammar.as_deref(),
                    guided_choice: self.guided_choice.as_deref(),
                    structured_outputs: self.structured_outputs.as_ref(),
                    regex: self.regex.as_deref(),
                    json_schema: self.json_schema.as_ref(),
                    ebnf: self.ebnf.as_deref(),
                }
            }

            pub fn knobs(&self) -> Knobs {
                Knobs {
                    temperature: self.temperature,
                    top_p: self.top_p,
                    top_k: self.top_k,
                    min_p: self.min_p,
                    presence_penalty: self.presence_penalty,
                    frequency_penalty: self.frequency_penalty,
                    repetition_penalty: self.repetition_penalty,
                    seed: self.seed,
                    stop: self.stop.clone(),
                    stop_token_ids: self.stop_token_ids.clone(),
                    n: self.n,
                    ignore_eos: self.ignore_eos,
                    stream: self.stream,
                    stream_options: self.stream_options.clone(),
                }
            }
        }
    )*};
}

shared_views!(CompletionRequest, ChatRequest);

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<Message>>,
    #[serde(default = "yes", deserialize_with = "null_yes")]
    pub add_special_tokens: bool,
}

fn yes() -> bool {
    true
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

/// OpenAI leaves an optional field at its default when it is `null`; so does kiln.
fn null_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

fn null_yes<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    Ok(Option::<bool>::deserialize(d)?.unwrap_or(true))
}

/// `response_format`: OpenAI's structured outputs.
#[derive(Deserialize, Debug, Clone)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema { json_schema: JsonSchemaFormat },
}

#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct JsonSchemaFormat {
    pub name: Option<String>,
    pub description: Option<String>,
    pub schema: Option<serde_json::Value>,
    pub strict: Option<bool>,
}

/// vLLM's `structured_outputs` object.
#[derive(Deserialize, Debug, Clone, Default)]
#[serde(deny_unknown_fields)]
pub struct StructuredOutputs {
    pub json: Option<serde_json::Value>,
    pub regex: Option<String>,
    pub grammar: Option<String>,
    pub choice: Option<Vec<String>>,
    pub json_object: Option<bool>,
}

/// The constraint fields of a request, whichever endpoint it came to.
pub struct ConstraintFields<'a> {
    pub response_format: Option<&'a ResponseFormat>,
    pub guided_json: Option<&'a serde_json::Value>,
    pub guided_regex: Option<&'a str>,
    pub guided_grammar: Option<&'a str>,
    pub guided_choice: Option<&'a [String]>,
    pub structured_outputs: Option<&'a StructuredOutputs>,
    pub regex: Option<&'a str>,
    pub json_schema: Option<&'a serde_json::Value>,
    pub ebnf: Option<&'a str>,
}
