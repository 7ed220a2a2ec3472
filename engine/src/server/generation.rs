//! One choice of a generation request, from the HTTP side: submit to the engine, then turn its
//! events into text deltas — detokenized incrementally, cut at stop strings — while the engine
//! runs the next step.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use super::error::ApiError;
use super::state::Ready;
use super::stop::StopMatcher;
use crate::batching::{EngineRequest, Event, RequestParams};
use crate::generate::FinishReason;
use crate::sampling::Sampled;
use crate::tokenizer::IncrementalDecoder;

/// New output of one choice.
#[derive(Debug, Default)]
pub struct Delta {
    pub index: usize,
    pub text: String,
    pub tokens: Vec<Sampled>,
    /// `stop` or `length` on the last delta.
    pub finish: Option<&'static str>,
    /// On the last delta: prompt tokens that came from the prefix cache.
    pub cached_tokens: usize,
}

pub struct Choice {
    pub index: usize,
    ready: Arc<Ready>,
    rx: UnboundedReceiver<Event>,
    decoder: IncrementalDecoder,
    stop: StopMatcher,
    pub completion_tokens: usize,
    cached_tokens: usize,
    done: bool,
}

/// Submits `n` choices of one prompt; `seed` + i seeds choice i, so n > 1 with a seed stays
/// reproducible and the choices differ.
pub fn submit(
    ready: &Arc<Ready>,
    prompt: &[u32],
    params: &RequestParams,
    stops: &[String],
    n: usize,
    first_index: usize,
) -> Result<Vec<Choice>, ApiError> {
    let status = &ready.engine.status;
    if n > ready.max_queue {
        // Retrying cannot help: the request needs more room than the whole queue has.
        return Err(ApiError::invalid(
            "n",
            format!(
                "{n} sequences can never fit the queue of {} (--max-queue)",
                ready.max_queue
            ),
        ));
    }
    if status.in_flight.load(Ordering::SeqCst) + n > ready.max_queue {
        return Err(ApiError::overloaded(1));
    }
    let mut choices = Vec::with_capacity(n);
    for i in 0..n {
        let (tx, rx) = unbounded_channel();
        let mut params = params.clone();
        let keep_special = params.keep_special;
        let enders = params.stop_token_ids.clone();
        params.sampling.seed = params.sampling.seed.map(|s| s.wrapping_add(i as u64));
        let req = EngineRequest {
            prompt: prompt.to_vec(),
            params,
            events: tx,
            arrival: Instant::now(),
        };
        if !ready.engine.submit(req) {
            return Err(ApiError::internal("the engine has stopped"));
        }
        choices.push(Choice {
            index: first_index + i,
            ready: ready.clone(),
            rx,
            decoder: if keep_special {
                IncrementalDecoder::keeping_special(enders)
            } else {
                IncrementalDecoder::new(true)
            },
            stop: StopMatcher::new(stops.to_vec()),
            completion_tokens: 0,
            cached_tokens: 0,
            done: false,
        });
    }
    Ok(choices)
}

impl Choice {
    /// The next delta; `None` after the last one.
    pub async fn next(&mut self) -> Option<Result<Delta, ApiError>> {
        if self.done {
            return None;
        }
        let mut delta = Delta {
            index: self.index,
            ..Default::default()
        };
        // Take everything already queued, so a slow client gets fewer, larger deltas.
        let first = self.rx.recv().await;
        let mut events = vec![first];
        while let Ok(e) = self.rx.try_recv() {
            events.push(Some(e));
        }
        for event in events {
            match event {
                Some(Event::Token { sampled, text }) => {
                    self.completion_tokens += 1;
                    let tok = &self.ready.model.tokenizer;
                    let piece = match text {
                        Some(t) => Some(t),
                        None => self.decoder.push(tok, sampled.token).unwrap_or_default(),
                    };
                    delta.tokens.push(sampled);
                    if let Some(piece) = piece {
                        let out = self.stop.push(&piece);
                        delta.text.push_str(&out.emit);
                        if out.stopped {
                            return Some(Ok(self.end(delta, "stop")));
                        }
                    }
                }
                Some(Event::Cached(n)) => self.cached_tokens = n,
                Some(Event::Finished { reason, .. }) => {
                    let tok = &self.ready.model.tokenizer;
                    if let Ok(Some(rest)) = self.decoder.flush(tok) {
                        let out = self.stop.push(&rest);
                        delta.text.push_str(&out.emit);
                        if out.stopped {
                            return Some(Ok(self.end(delta, "stop")));
                        }
                    }
                    delta.text.push_str(&self.stop.flush());
                    let why = match reason {
                        FinishReason::Eos => "stop",
                        FinishReason::Length | FinishReason::ContextFull => "length",
                    };
                    return Some(Ok(self.end(delta, why)));
                }
                Some(Event::Failed(msg)) => {
                    self.done = true;
                    return Some(Err(ApiError::internal(msg)));
                }
                None => {
                    self.done = true;
                    return Some(Err(ApiError::internal("the engine dropped the request")));
                }
            }
        }
        Some(Ok(delta))
    }

    /// Runs the choice to its end (non-streaming responses): all deltas folded into one.
    pub async fn collect(&mut self) -> Result<Delta, ApiError> {
        let mut all = Delta {
            index: self.index,
            ..Default::default()
        };
        while let Some(d) = self.next().await {
            let d = d?;
            all.text.push_str(&d.text);
            all.tokens.extend(d.tokens);
            all.finish = d.finish.or(all.finish);
            all.cached_tokens = all.cached_tokens.max(d.cached_tokens);
        }
        Ok(all)
    }

    fn end(&mut self, delta: Delta, why: &'static str) -> Delta {
        self.done = true;
        // Closing our end tells the engine to stop this sequence at its next step.
        self.rx.close();
        Delta {
            finish: Some(why),
            cached_tokens: self.cached_tokens,
            ..delta
        }
    }
}
