use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};
use kiln::backend::{Backend, Precision};
use kiln::catalog::DEFAULT_MODEL;
use kiln::generate::{GenerateOptions, SingleSequence};
use kiln::load::load_model;
use kiln::runner::{Device, WithBackend};
use kiln::sampling::SamplingParams;
use kiln::tokenizer::{ChatMessage, IncrementalDecoder};

#[derive(clap::Args)]
pub struct GenerateArgs {
    /// A .gguf file or a Hugging Face model directory (default: SmolLM2-135M-Instruct Q4_1 from the cache).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Raw prompt text (special tokens like <|im_start|> are recognised).
    #[arg(long, group = "input")]
    prompt: Option<String>,
    /// A user message, wrapped in the model's chat template.
    #[arg(long, group = "input")]
    chat: Option<String>,
    /// Prompt token ids, comma-separated.
    #[arg(long, group = "input", value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    #[arg(long)]
    seed: Option<u64>,
    /// Keep generating past the end-of-sequence token.
    #[arg(long)]
    ignore_eos: bool,
    #[arg(long, value_enum, default_value_t = Precision::Fast)]
    mode: Precision,
    /// Where the model runs: cpu, or cuda (refused with the reason where this build or machine
    /// cannot; never a silent CPU fallback).
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    device: Device,
    /// Print one JSON object {"prompt_ids", "output_ids", "text"} and nothing else on stdout.
    #[arg(long)]
    json: bool,
    /// Worker threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Model cache directory (see `kiln fetch --help`).
    #[arg(long)]
    cache_dir: Option<PathBuf>,
}

pub fn run(a: GenerateArgs) -> anyhow::Result<()> {
    if let Some(t) = a.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(t.max(1))
            .build_global()
            .context("setting up worker threads")?;
    }
    let path = match &a.model {
        Some(p) => p.clone(),
        None => DEFAULT_MODEL.require(&super::cache_dir(a.cache_dir.clone()))?,
    };
    let bar = ProgressBar::new(1);
    bar.set_style(
        ProgressStyle::with_template("loading {msg} [{bar:30}] {pos}/{len} layers")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(
        path.file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default(),
    );
    a.device.check(a.mode)?;
    let job = Generate { a: &a, path, bar };
    a.device.with_backend(a.threads, job)?
}

/// The rest of `kiln generate`, over the backend `--device` chose.
struct Generate<'a> {
    a: &'a GenerateArgs,
    path: PathBuf,
    bar: ProgressBar,
}

impl WithBackend for Generate<'_> {
    type Output = anyhow::Result<()>;

    fn run<B: Backend + 'static>(self, backend: B) -> anyhow::Result<()> {
        generate(self.a, &self.path, &self.bar, backend)
    }
}

fn generate<B: Backend>(
    a: &GenerateArgs,
    path: &std::path::Path,
    bar: &ProgressBar,
    backend: B,
) -> anyhow::Result<()> {
    let m = load_model(backend, path, a.mode, |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })?;
    bar.finish_and_clear();

    let prompt_ids = if let Some(ids) = &a.prompt_ids {
        ids.clone()
    } else if let Some(text) = &a.chat {
        let tmpl = m
            .tokenizer
            .chat_template
            .as_ref()
            .context("this model has no chat template; use --prompt")?;
        let rendered = tmpl.render(&[ChatMessage::new("user", text.as_str())], true)?;
        m.tokenizer.encode(&rendered, false)?
    } else if let Some(text) = &a.prompt {
        m.tokenizer.encode(text, true)?
    } else {
        bail!("give one of --prompt, --chat or --prompt-ids");
    };
    let opts = GenerateOptions {
        max_tokens: a.max_tokens,
        ignore_eos: a.ignore_eos,
        sampling: SamplingParams {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            min_p: a.min_p,
            repetition_penalty: a.repetition_penalty,
            seed: a.seed,
            ..Default::default()
        },
        ..Default::default()
    };
    let context = m
        .config()
        .max_context
        .min(prompt_ids.len() + a.max_tokens + 1);
    let mut seq = SingleSequence::new(&m, context)?;
    let mut decoder = IncrementalDecoder::new(true);
    let mut stdout = std::io::stdout().lock();
    let mut text = String::new();
    let mut stream_err = None;
    let result = seq.generate(&m, &prompt_ids, &opts, |s| {
        if m.tokenizer.is_eos(s.token) && !a.ignore_eos {
            return;
        }
        match decoder.push(&m.tokenizer, s.token) {
            Ok(Some(piece)) => {
                if !a.json {
                    let _ = write!(stdout, "{piece}");
                    let _ = stdout.flush();
                }
                text.push_str(&piece);
            }
            Ok(None) => {}
            Err(e) => stream_err = Some(e),
        }
    })?;
    if let Some(e) = stream_err {
        return Err(e.into());
    }
    if let Some(rest) = decoder.flush(&m.tokenizer)? {
        if !a.json {
            write!(stdout, "{rest}")?;
        }
        text.push_str(&rest);
    }
    let output_ids = result.ids();
    if a.json {
        let obj =
            serde_json::json!({"prompt_ids": prompt_ids, "output_ids": output_ids, "text": text});
        writeln!(stdout, "{obj}")?;
    } else {
        writeln!(stdout)?;
        let n_out = output_ids.len();
        eprintln!(
            "prefill: {} tokens in {:.3}s ({:.1} tok/s) | decode: {} tokens in {:.3}s ({:.1} tok/s) | {:?} mode, {}, finish: {:?}",
            prompt_ids.len(),
            result.prefill_time.as_secs_f64(),
            prompt_ids.len() as f64 / result.prefill_time.as_secs_f64().max(1e-9),
            n_out.saturating_sub(1),
            result.decode_time.as_secs_f64(),
            n_out.saturating_sub(1) as f64 / result.decode_time.as_secs_f64().max(1e-9),
            a.mode,
            m.backend.describe(),
            result.finish,
        );
    }
    Ok(())
}
