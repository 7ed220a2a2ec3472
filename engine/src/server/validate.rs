//! Request fields checked against their ranges and the model: every rejection names its field.

use super::error::ApiError;
use super::protocol::Knobs;
use crate::batching::RequestParams;
use crate::sampling::SamplingParams;

/// Everything a generation endpoint needs besides the prompt.
#[derive(Debug, Clone)]
pub struct Plan {
    pub n: usize,
    pub stops: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// `max_tokens` as asked (None: up to the context).
    pub max_tokens: Option<usize>,
    pub params: RequestParams,
}

pub struct Limits {
    pub max_model_len: usize,
    pub vocab_size: usize,
    pub max_n: usize,
}

fn range(param: &str, v: Option<f32>, lo: f32, hi: f32, default: f32) -> Result<f32, ApiError> {
    match v {
        None => Ok(default),
        Some(x) if x.is_finite() && (lo..=hi).contains(&x) => Ok(x),
        Some(x) => Err(ApiError::invalid(
            param,
            format!("`{param}` must be between {lo} and {hi}, got {x}"),
        )),
    }
}

/// `top_logprobs` is the number of alternatives per token (0..=20) when logprobs are wanted.
pub fn plan(
    k: &Knobs,
    max_tokens: Option<i64>,
    top_logprobs: Option<usize>,
    limits: &Limits,
) -> Result<Plan, ApiError> {
    let temperature = range("temperature", k.temperature, 0.0, 2.0, 1.0)?;
    let top_p = range("top_p", k.top_p, 0.0, 1.0, 1.0)?;
    if top_p == 0.0 {
        return Err(ApiError::invalid("top_p", "`top_p` must be greater than 0"));
    }
    let min_p = range("min_p", k.min_p, 0.0, 1.0, 0.0)?;
    let presence = range("presence_penalty", k.presence_penalty, -2.0, 2.0, 0.0)?;
    let frequency = range("frequency_penalty", k.frequency_penalty, -2.0, 2.0, 0.0)?;
    let repetition = range("repetition_penalty", k.repetition_penalty, 0.01, 10.0, 1.0)?;
    let top_k = match k.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(x) if x > 0 => x as usize,
        Some(x) => {
            return Err(ApiError::invalid(
                "top_k",
                format!("`top_k` must be -1 (off) or positive, got {x}"),
            ));
        }
    };
    let n = match k.n {
        None => 1,
        Some(x) if x >= 1 && x as usize <= limits.max_n => x as usize,
        Some(x) => {
            return Err(ApiError::invalid(
                "n",
                format!("`n` must be between 1 and {}, got {x}", limits.max_n),
            ));
        }
    };
    let max_tokens = match max_tokens {
        None => None,
        Some(x) if x >= 1 && (x as u64) < limits.max_model_len as u64 => Some(x as usize),
        Some(x) if x < 1 => {
            return Err(ApiError::invalid(
                "max_tokens",
                format!("`max_tokens` must be at least 1, got {x}"),
            ));
        }
        Some(x) => {
            return Err(ApiError::invalid(
                "max_tokens",
                format!(
                    "`max_tokens` is {x}; this model's context holds {} tokens",
                    limits.max_model_len
                ),
            )
            .with_code("context_length_exceeded"));
        }
    };
    let stops = k.stop.clone().map(|s| s.into_vec()).unwrap_or_default();
    if stops.len() > 16 {
        return Err(ApiError::invalid("stop", "at most 16 stop strings"));
    }
    if stops.iter().any(|s| s.is_empty()) {
        return Err(ApiError::invalid("stop", "stop strings must not be empty"));
    }
    let stop_token_ids = k.stop_token_ids.clone().unwrap_or_default();
    if let Some(bad) = stop_token_ids
        .iter()
        .find(|&&t| t as usize >= limits.vocab_size)
    {
        return Err(ApiError::invalid(
            "stop_token_ids",
            format!(
                "token id {bad} is outside the vocabulary ({} tokens)",
                limits.vocab_size
            ),
        ));
    }
    if k.stream_options.is_some() && !k.stream {
        return Err(ApiError::invalid(
            "stream_options",
            "`stream_options` is only allowed when `stream` is true",
        ));
    }
    Ok(Plan {
        n,
        stops,
        stream: k.stream,
        include_usage: k.stream_options.as_ref().is_some_and(|o| o.include_usage),
        max_tokens,
        params: RequestParams {
            max_tokens: max_tokens.unwrap_or(usize::MAX),
            sampling: SamplingParams {
                temperature,
                top_k,
                top_p,
                min_p,
                repetition_penalty: repetition,
                presence_penalty: presence,
                frequency_penalty: frequency,
                seed: k.seed,
                logprobs: top_logprobs.is_some(),
                top_logprobs: top_logprobs.unwrap_or(0),
            },
            ignore_eos: k.ignore_eos,
            stop_token_ids,
            guide: None,
            keep_special: false,
        },
    })
}

/// Checks the prompt against the context and fixes `max_tokens`: when unset, `default_max` (or all
/// that remains of the context) capped by what remains. `param` names the prompt field.
pub fn fit_prompt(
    plan: &Plan,
    param: &str,
    prompt_len: usize,
    default_max: Option<usize>,
    limits: &Limits,
) -> Result<RequestParams, ApiError> {
    if prompt_len == 0 {
        return Err(ApiError::invalid(param, "the prompt is empty"));
    }
    let room = limits.max_model_len.saturating_sub(prompt_len);
    let want = match plan.max_tokens {
        Some(m) => m,
        None => default_max.map_or(room, |d| d.min(room)),
    };
    if room == 0 || want > room {
        return Err(ApiError::invalid(
            param,
            format!(
                "This model's maximum context length is {} tokens. However, you requested {} \
                 tokens ({prompt_len} in the prompt, {want} for the completion).",
                limits.max_model_len,
                prompt_len + want.max(1)
            ),
        )
        .with_code("context_length_exceeded"));
    }
    let mut params = plan.params.clone();
    params.max_tokens = want;
    Ok(params)
}

/// `logprobs` (completions) or `top_logprobs` (chat): 0..=20 alternatives.
pub fn top_logprobs(param: &str, v: Option<i64>) -> Result<Option<usize>, ApiError> {
    match v {
        None => Ok(None),
        Some(x) if (0..=20).contains(&x) => Ok(Some(x as usize)),
        Some(x) => Err(ApiError::invalid(
            param,
            format!("`{param}` must be between 0 and 20, got {x}"),
        )),
    }
}

/// 400 `context_length_exceeded` for a text whose token count is known to be at least
/// `at_least` (before tokenizing it) and reaches the context.
pub fn check_text_fits(param: &str, at_least: usize, limits: &Limits) -> Result<(), ApiError> {
    if at_least < limits.max_model_len {
        return Ok(());
    }
    Err(ApiError::invalid(
        param,
        format!(
            "This model's maximum context length is {} tokens; the prompt has at least {at_least}.",
            limits.max_model_len
        ),
    )
    .with_code("context_length_exceeded"))
}
