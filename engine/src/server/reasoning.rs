//! Reasoning models think between markers before they answer: `--reasoning-parser` (SGLang's
//! names) moves that text out of `content` into `reasoning_content`, in whole replies and in
//! stream deltas. The parsing is the `reasoning-parser` crate (SGLang's Rust gateway).

use std::sync::OnceLock;

use reasoning_parser::ReasoningParser;

/// SGLang's `--reasoning-parser` names, with the crate's parser for each.
const PARSERS: &[(&str, &str)] = &[
    // `<think>` ... `</think>`; R1 may leave out the opening tag (its template writes it).
    ("deepseek-r1", "deepseek_r1"),
    ("qwen3", "qwen3"),
    ("qwen3-thinking", "qwen3_thinking"),
    // Kimi's `◁think▷` ... `◁/think▷`.
    ("kimi", "kimi"),
    // Kimi-K2-Thinking writes `<think>` ... `</think>`.
    ("kimi_k2", "kimi_k25"),
    ("glm45", "glm45"),
];

/// The crate's parser for `--reasoning-parser NAME`.
pub fn resolve(name: &str) -> Result<&'static str, String> {
    PARSERS
        .iter()
        .find(|(sglang, _)| *sglang == name)
        .map(|(_, parser)| *parser)
        .ok_or_else(|| {
            let known: Vec<&str> = PARSERS.iter().map(|(n, _)| *n).collect();
            format!(
                "--reasoning-parser `{name}` is not known (known: {})",
                known.join(", ")
            )
        })
}

fn factory() -> &'static reasoning_parser::ParserFactory {
    static FACTORY: OnceLock<reasoning_parser::ParserFactory> = OnceLock::new();
    FACTORY.get_or_init(reasoning_parser::ParserFactory::new)
}

/// One reply's reasoning splitter.
pub struct Reasoning {
    parser: Box<dyn ReasoningParser>,
}

impl Reasoning {
    pub fn new(parser: &str) -> Option<Reasoning> {
        Some(Reasoning {
            parser: factory().registry().create_parser(parser)?,
        })
    }

    /// A whole reply as (reasoning, answer); text that does not parse is all answer.
    pub fn split(&mut self, text: &str) -> (Option<String>, String) {
        match self.parser.detect_and_parse_reasoning(text) {
            Ok(r) => (
                (!r.reasoning_text.is_empty()).then_some(r.reasoning_text),
                r.normal_text,
            ),
            Err(_) => (None, text.to_string()),
        }
    }

    /// A streamed piece as (reasoning, answer); `last` flushes what the parser holds.
    pub fn feed(&mut self, text: &str, last: bool) -> (String, String) {
        let (mut reasoning, mut answer) = (String::new(), String::new());
        if !text.is_empty() {
            match self.parser.parse_reasoning_streaming_incremental(text) {
                Ok(r) => {
                    reasoning.push_str(&r.reasoning_text);
                    answer.push_str(&r.normal_text);
                }
                Err(_) => answer.push_str(text),
            }
        }
        if last && let Ok(r) = self.parser.flush() {
            reasoning.push_str(&r.reasoning_text);
            answer.push_str(&r.normal_text);
        }
        (reasoning, answer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The markers each family writes (SGLang's `reasoning_parser.py` and its tests).
    fn sample(name: &str) -> &'static str {
        match name {
            "kimi" => "◁think▷The user wants 2+2.◁/think▷It is 4.",
            _ => "<think>The user wants 2+2.</think>It is 4.",
        }
    }

    #[test]
    fn each_family_splits_whole_and_streamed_replies() {
        for (sglang, _) in PARSERS.iter().filter(|(n, _)| *n != "glm45") {
            let parser = resolve(sglang).expect("known");
            let (reasoning, answer) = Reasoning::new(parser)
                .expect("parser")
                .split(sample(sglang));
            assert_eq!(
                reasoning.as_deref().map(str::trim),
                Some("The user wants 2+2."),
                "{sglang}"
            );
            assert_eq!(answer.trim(), "It is 4.", "{sglang}");
            let mut r = Reasoning::new(parser).expect("parser");
            let chars: Vec<char> = sample(sglang).chars().collect();
            let (mut reasoning, mut answer) = (String::new(), String::new());
            let pieces: Vec<String> = chars.chunks(2).map(|c| c.iter().collect()).collect();
            for (i, p) in pieces.iter().enumerate() {
                let (a, b) = r.feed(p, i + 1 == pieces.len());
                reasoning.push_str(&a);
                answer.push_str(&b);
            }
            assert_eq!(reasoning.trim(), "The user wants 2+2.", "{sglang}");
            assert_eq!(answer.trim(), "It is 4.", "{sglang}");
        }
    }

    #[test]
    fn deepseek_r1_reasons_without_its_opening_tag() {
        let (reasoning, answer) = Reasoning::new("deepseek_r1")
            .expect("parser")
            .split("Thinking it over.</think>Yes.");
        assert_eq!(
            reasoning.as_deref().map(str::trim),
            Some("Thinking it over.")
        );
        assert_eq!(answer.trim(), "Yes.");
        assert!(resolve("nope").is_err_and(|e| e.contains("deepseek-r1")));
    }
}
