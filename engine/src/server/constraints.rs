//! Structured outputs on the wire: a request's constraint fields (OpenAI's `response_format`,
//! vLLM's `guided_*` and `structured_outputs`, SGLang's `regex` and `json_schema`) become one
//! constraint, compiled into a matcher over the model's vocabulary. Every fault names its field.

use serde_json::Value;

use super::error::ApiError;
use super::protocol::{ConstraintFields, ResponseFormat};
use super::state::Ready;
use crate::structured::{Constraint, Guide};

/// The request's matcher, if it constrains its output.
pub fn guide(ready: &Ready, fields: &ConstraintFields<'_>) -> Result<Option<Guide>, ApiError> {
    let Some((field, c)) = constraint(fields)? else {
        return Ok(None);
    };
    compile(ready, field, &c).map(Some)
}

/// `c` compiled into a matcher; its faults name `field`.
pub fn compile(ready: &Ready, field: &str, c: &Constraint) -> Result<Guide, ApiError> {
    let grammars = ready.grammars().map_err(|e| {
        ApiError::invalid(
            field,
            format!("structured outputs are unavailable for this model: {e}"),
        )
    })?;
    grammars
        .guide(c)
        .map_err(|e| ApiError::invalid(field, format!("invalid `{field}`: {e}")))
}

/// The one constraint the fields ask for (two at once are refused).
pub fn constraint(
    f: &ConstraintFields<'_>,
) -> Result<Option<(&'static str, Constraint)>, ApiError> {
    let mut found: Vec<(&'static str, Constraint)> = Vec::new();
    match f.response_format {
        None | Some(ResponseFormat::Text) => {}
        Some(ResponseFormat::JsonObject) => found.push(("response_format", Constraint::JsonObject)),
        Some(ResponseFormat::JsonSchema { json_schema }) => {
            let field = "response_format.json_schema.schema";
            let schema = json_schema
                .schema
                .as_ref()
                .ok_or_else(|| ApiError::invalid(field, format!("`{field}` is required")))?;
            found.push((
                "response_format",
                Constraint::JsonSchema(schema_of(field, schema)?),
            ));
        }
    }
    if let Some(s) = f.guided_json {
        found.push((
            "guided_json",
            Constraint::JsonSchema(schema_of("guided_json", s)?),
        ));
    }
    if let Some(s) = f.json_schema {
        found.push((
            "json_schema",
            Constraint::JsonSchema(schema_of("json_schema", s)?),
        ));
    }
    if let Some(r) = f.guided_regex {
        found.push(("guided_regex", Constraint::Regex(r.to_string())));
    }
    if let Some(r) = f.regex {
        found.push(("regex", Constraint::Regex(r.to_string())));
    }
    if let Some(g) = f.guided_grammar {
        found.push(("guided_grammar", Constraint::Lark(g.to_string())));
    }
    if let Some(c) = f.guided_choice {
        found.push(("guided_choice", choice("guided_choice", c)?));
    }
    if let Some(so) = f.structured_outputs {
        let field = "structured_outputs";
        if let Some(s) = &so.json {
            found.push((
                field,
                Constraint::JsonSchema(schema_of("structured_outputs.json", s)?),
            ));
        }
        if let Some(r) = &so.regex {
            found.push((field, Constraint::Regex(r.clone())));
        }
        if let Some(g) = &so.grammar {
            found.push((field, Constraint::Lark(g.clone())));
        }
        if let Some(c) = &so.choice {
            found.push((field, choice("structured_outputs.choice", c)?));
        }
        if so.json_object == Some(true) {
            found.push((field, Constraint::JsonObject));
        }
    }
    if f.ebnf.is_some() {
        return Err(ApiError::invalid(
            "ebnf",
            "`ebnf` grammars are not supported; send the grammar in Lark syntax as \
             `guided_grammar` (llguidance's dialect: https://github.com/guidance-ai/llguidance)",
        ));
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|(f, _)| *f).collect();
        return Err(ApiError::invalid(
            names[1],
            format!(
                "send one output constraint, not several ({})",
                names.join(", ")
            ),
        ));
    }
    Ok(found.pop())
}

/// A JSON schema given as an object (or `true`), or as a string holding one.
fn schema_of(field: &str, v: &Value) -> Result<Value, ApiError> {
    let v = match v {
        Value::String(text) => serde_json::from_str(text).map_err(|e| {
            ApiError::invalid(field, format!("`{field}` is not a JSON schema: {e}"))
        })?,
        other => other.clone(),
    };
    match v {
        Value::Object(_) | Value::Bool(true) => Ok(v),
        _ => Err(ApiError::invalid(
            field,
            format!("`{field}` must be a JSON schema object"),
        )),
    }
}

/// One of the given strings, exactly.
fn choice(field: &str, options: &[String]) -> Result<Constraint, ApiError> {
    if options.is_empty() {
        return Err(ApiError::invalid(
            field,
            format!("`{field}` must list at least one choice"),
        ));
    }
    let alternatives: Vec<String> = options.iter().map(|o| regex_escape(o)).collect();
    Ok(Constraint::Regex(format!("({})", alternatives.join("|"))))
}

fn regex_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if "\\.+*?()|[]{}^$#&-~ ".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::protocol::ChatRequest;

    fn fields_of(body: Value) -> Result<Option<(&'static str, Constraint)>, ApiError> {
        let req: ChatRequest = serde_json::from_value(body).expect("request");
        constraint(&req.constraint_fields())
    }

    #[test]
    fn each_field_maps_to_its_constraint() {
        let base = serde_json::json!({"messages": [{"role": "user", "content": "hi"}]});
        let with = |k: &str, v: Value| {
            let mut b = base.clone();
            b[k] = v;
            fields_of(b).expect("valid").map(|(_, c)| c)
        };
        assert_eq!(
            with("response_format", serde_json::json!({"type": "text"})),
            None
        );
        assert_eq!(
            with(
                "response_format",
                serde_json::json!({"type": "json_object"})
            ),
            Some(Constraint::JsonObject)
        );
        let schema =
            serde_json::json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        assert_eq!(
            with(
                "response_format",
                serde_json::json!({"type": "json_schema",
                                   "json_schema": {"name": "x", "schema": schema, "strict": true}})
            ),
            Some(Constraint::JsonSchema(schema.clone()))
        );
        assert_eq!(
            with("guided_json", Value::String(schema.to_string())),
            Some(Constraint::JsonSchema(schema))
        );
        assert_eq!(
            with("guided_choice", serde_json::json!(["yes", "no (maybe)"])),
            Some(Constraint::Regex(r"(yes|no\ \(maybe\))".into()))
        );
        assert_eq!(
            with("regex", "[0-9]+".into()),
            Some(Constraint::Regex("[0-9]+".into()))
        );
    }

    #[test]
    fn two_constraints_or_a_bad_schema_are_refused_by_name() {
        let err = fields_of(serde_json::json!({"messages": [], "regex": "a", "guided_regex": "b"}))
            .expect_err("two constraints");
        assert!(err.message.contains("regex"), "{}", err.message);
        let err = fields_of(serde_json::json!({"messages": [], "guided_json": "[1"}))
            .expect_err("not JSON");
        assert_eq!(err.param.as_deref(), Some("guided_json"));
        let err = fields_of(serde_json::json!({"messages": [],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}))
        .expect_err("no schema");
        assert_eq!(
            err.param.as_deref(),
            Some("response_format.json_schema.schema")
        );
    }
}
