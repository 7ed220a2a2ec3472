//! `kiln serve`: the OpenAI-compatible HTTP server around the continuous-batching engine.
//!
//! Start-up order, as systemd and load balancers expect: bind the port (so `/health` and
//! `/metrics` answer at once), load the model on a blocking thread with `STATUS=` progress, warm
//! it up with one real generation, then `READY=1` and `/ready` turns 200. On SIGTERM/SIGINT:
//! `STOPPING=1`, new generation requests get 503, in-flight ones finish (up to the shutdown
//! timeout), exit 0.

pub mod auth;
pub mod constraints;
pub mod drift;
pub mod error;
pub mod generation;
pub mod guard;
pub mod listen;
pub mod protocol;
pub mod reasoning;
pub mod routes;
pub mod sse;
pub mod state;
pub mod stop;
pub mod systemd;
pub mod tools;
pub mod validate;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context;
use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::middleware;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use tokio::net::TcpListener;

use crate::batching::{self, EngineConfig, EngineRequest, Event, RequestParams};
use crate::runner::{self, KvSize, LoadSpec, ModelInfo, RunnerConfig};

use crate::metrics::Metrics;
use crate::sampling::SamplingParams;
use error::ApiError;
use state::{AppState, Ready, ServeOptions, Shared, unix_now};
use systemd::Notifier;

/// The route table.
pub fn router(state: Shared) -> Router {
    let limit = state.opts.max_body_bytes;
    let api = Router::new()
        .route("/v1/completions", post(routes::completions::handle))
        .route("/v1/chat/completions", post(routes::chat::handle))
        .route("/v1/models", get(routes::info::models))
        .route("/model_info", get(routes::info::model_info))
        .route("/tokenize", post(routes::info::tokenize))
        .route("/detokenize", post(routes::info::detokenize))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            auth::require_api_key,
        ));
    let open = Router::new()
        .route("/health", get(routes::health::health))
        .route("/ready", get(routes::health::ready))
        .route("/metrics", get(routes::health::metrics));
    api.merge(open)
        .fallback(|| async { ApiError::not_found("Unknown route").into_response() })
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed().into_response() })
        .layer(DefaultBodyLimit::max(limit))
        .layer(middleware::from_fn_with_state(state.clone(), guard::guard))
        .with_state(state)
}

fn model_id(opts: &ServeOptions) -> String {
    opts.served_model_name.clone().unwrap_or_else(|| {
        opts.model_path
            .file_name()
            .map(|n| n.to_string_lossy().trim_end_matches(".gguf").to_string())
            .unwrap_or_else(|| "model".into())
    })
}

pub async fn run(opts: ServeOptions) -> anyhow::Result<()> {
    let notifier = Notifier::new(opts.notify_socket.clone());
    let id = model_id(&opts);
    let metrics = Arc::new(Metrics::new(&id, &opts.instance));
    let addr = format!("{}:{}", opts.host, opts.port);
    let listener = TcpListener::bind(&addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    let local = listener.local_addr().context("reading the bound address")?;
    let state: Shared = Arc::new(AppState {
        opts: opts.clone(),
        metrics: metrics.clone(),
        ready: Default::default(),
        draining: Default::default(),
        cut: tokio::sync::watch::channel(false).0,
        prep: tokio::sync::Semaphore::new(
            std::thread::available_parallelism().map_or(2, |n| n.get().max(2)),
        ),
        canary_running: Default::default(),
        drift: Default::default(),
    });
    if let Some(guard) = &opts.lock {
        drift::publish_checks(&state, &guard.checks);
    }
    eprintln!(
        "kiln: listening on http://{local} (loading {})",
        opts.model_path.display()
    );
    notifier.status("loading the model");

    ignore_reload_signals();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let limits = listen::ConnLimits {
        header_timeout: opts.header_timeout,
        max_connections: listen::connection_cap(opts.max_connections),
    };
    if limits.max_connections < opts.max_connections {
        eprintln!(
            "kiln: at most {} open connections (the file-descriptor limit; --max-connections {})",
            limits.max_connections, opts.max_connections
        );
    }
    let server = tokio::spawn(listen::serve(
        listener,
        router(state.clone()),
        limits,
        stop_rx,
    ));
    if let Some(period) = opts.watchdog {
        tokio::spawn(watchdog(state.clone(), notifier.clone(), period));
    }

    let startup = start_engine(state.clone(), id, notifier.clone());
    tokio::select! {
        r = startup => {
            r?;
            if let Some((guard, canary)) = opts
                .lock
                .clone()
                .and_then(|g| g.canary.clone().map(|c| (g, c)))
            {
                notifier.status("running the canary benchmark");
                let url = format!("http://127.0.0.1:{}", local.port());
                let passed = drift::run_canary(&state, &canary, &url).await;
                if !passed && guard.refuse {
                    state.draining.store(true, Ordering::SeqCst);
                    let _ = stop_tx.send(());
                    anyhow::bail!(
                        "the canary benchmark fell below the numbers in {} and the drift policy is refuse",
                        guard.lock_file
                    );
                }
            }
            notifier.ready();
            eprintln!("kiln: ready on http://{local}");
            shutdown_signal().await;
        }
        _ = shutdown_signal() => {}
    }
    drain(&state, &notifier).await;
    // Nothing is in flight now: stop accepting, and give open connections a moment to close.
    let _ = stop_tx.send(());
    match tokio::time::timeout(DRAIN_CLOSE, server).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!("server task: {e}"),
        Err(_) => eprintln!("kiln: closing the remaining connections"),
    }
    Ok(())
}

/// How long connections may take to close once nothing is in flight.
const DRAIN_CLOSE: Duration = Duration::from_secs(2);

/// Draining: the listener stays up and answers new generation requests (and /ready) with 503
/// and `Retry-After` while the requests in flight finish, for up to `--shutdown-timeout`; what
/// is still running then is cut (streams get an error event and `[DONE]`).
async fn drain(state: &Shared, notifier: &Notifier) {
    state.draining.store(true, Ordering::SeqCst);
    notifier.stopping();
    let timeout = state.opts.shutdown_timeout;
    eprintln!("kiln: draining (up to {}s)", timeout.as_secs());
    let deadline = tokio::time::Instant::now() + timeout;
    let in_flight = || {
        state
            .ready
            .get()
            .map_or(0, |r| r.engine.status.in_flight.load(Ordering::SeqCst))
    };
    while in_flight() > 0 {
        if tokio::time::Instant::now() >= deadline {
            eprintln!(
                "kiln: shutdown timeout reached; cutting {} request(s)",
                in_flight()
            );
            let _ = state.cut.send(true);
            // The cut streams write their last events.
            tokio::time::sleep(Duration::from_millis(300)).await;
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Loads the model into a runner, starts the engine thread, warms it up with one generation, and
/// publishes it.
async fn start_engine(state: Shared, model_id: String, notifier: Notifier) -> anyhow::Result<()> {
    let opts = state.opts.clone();
    let spec = LoadSpec {
        device: opts.device,
        model: opts.model_path.clone(),
        precision: opts.precision,
        threads: opts.threads,
        tensor_parallel: opts.tensor_parallel,
        collective_timeout: opts.collective_timeout,
        group: opts.group,
        moe_split: opts.moe_split,
        draft_model: opts.draft_model.clone(),
        mem_fraction: match opts.kv {
            KvSize::MemoryFraction(f) => Some(f),
            KvSize::Tokens(_) => None,
        },
        runner: RunnerConfig {
            kv_tokens: match opts.kv {
                KvSize::Tokens(t) => t,
                // Measured at load.
                KvSize::MemoryFraction(_) => 0,
            },
            block_size: opts.block_size,
            max_step_tokens: opts.max_step_tokens,
            spec: opts.spec,
            sampling: Default::default(),
            graphs: opts.graphs,
            overlap: opts.overlap_schedule,
        },
    };
    let n2 = notifier.clone();
    let (runner, info) =
        tokio::task::spawn_blocking(move || runner::load(&spec, &mut |s| n2.status(&s)))
            .await
            .context("the loading thread failed")?
            .with_context(|| format!("loading {}", state.opts.model_path.display()))?;
    let opts = &state.opts;
    let kv_tokens = {
        let (blocks, block_size) = runner.kv_layout();
        blocks * block_size
    };
    let context = info.config.max_context;
    let max_model_len = opts
        .max_model_len
        .unwrap_or(context)
        .min(context)
        .min(kv_tokens);
    if kv_tokens < opts.max_model_len.unwrap_or(context).min(context) {
        tracing::warn!("max_model_len capped at {max_model_len} tokens by the KV cache size");
    }
    tracing::info!("{} on {}: {kv_tokens} KV tokens", info.name, info.backend);
    let cfg = EngineConfig {
        max_running: opts.max_running,
        max_step_tokens: opts.max_step_tokens,
        max_model_len,
        detok_overlap: opts.detok_overlap,
        prefix_cache: opts.prefix_cache,
    };
    let engine = batching::spawn(runner, cfg, state.metrics.clone())
        .context("starting the engine thread")?;
    notifier.status("warming up");
    warm_up(&engine, &info).await?;
    let tool_parser = opts.tool_call_parser.or_else(|| {
        let template = info.tokenizer.chat_template.as_ref().map(|t| t.source());
        tools::resolve(None, template).ok().flatten()
    });
    let ready = Ready {
        model: info,
        engine,
        model_id,
        max_model_len,
        kv_tokens,
        max_queue: opts.max_queue,
        max_n: opts.max_n,
        created: unix_now(),
        grammars: std::sync::OnceLock::new(),
        tool_parser,
    };
    let _ = state.ready.set(Arc::new(ready));
    state.metrics.ready.set(1);
    Ok(())
}

/// One short greedy generation through the real path, so the first request does not pay for
/// first-touch page faults and thread start-up.
async fn warm_up(engine: &batching::EngineHandle, model: &ModelInfo) -> anyhow::Result<()> {
    // A tokenizer may know more tokens than the model's vocabulary (a tiny test model with a
    // borrowed tokenizer): warm up on ids the model has.
    let vocab = model.config().vocab_size as u32;
    let prompt: Vec<u32> = model
        .tokenizer
        .encode("Hello, world.", true)
        .context("encoding the warm-up prompt")?
        .into_iter()
        .map(|id| id % vocab)
        .collect();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let req = EngineRequest {
        prompt,
        params: RequestParams {
            max_tokens: 4,
            sampling: SamplingParams::greedy(),
            ignore_eos: true,
            stop_token_ids: vec![],
            guide: None,
            keep_special: false,
        },
        events: tx,
        arrival: std::time::Instant::now(),
    };
    anyhow::ensure!(engine.submit(req), "the engine thread stopped");
    while let Some(e) = rx.recv().await {
        match e {
            Event::Token { .. } | Event::Cached(_) => {}
            Event::Finished { .. } => return Ok(()),
            Event::Failed(m) => anyhow::bail!("warm-up failed: {m}"),
        }
    }
    anyhow::bail!("the engine thread stopped during warm-up")
}

/// Pings systemd's watchdog at half its period while loading, and afterwards only while the engine
/// loop keeps turning — a wedged engine gets the service restarted.
async fn watchdog(state: Shared, notifier: Notifier, period: Duration) {
    let mut tick = tokio::time::interval(period / 2);
    loop {
        tick.tick().await;
        let healthy = match state.ready.get() {
            None => true,
            Some(r) => r.engine.since_heartbeat() < period,
        };
        if healthy {
            notifier.watchdog();
        }
    }
}

/// SIGHUP and SIGUSR1 (sent by log rotation and some supervisors) are logged and ignored: kiln
/// reads its configuration at start, and their default action would kill it without draining.
fn ignore_reload_signals() {
    use tokio::signal::unix::{SignalKind, signal};
    for (kind, name) in [
        (SignalKind::hangup(), "SIGHUP"),
        (SignalKind::user_defined1(), "SIGUSR1"),
    ] {
        if let Ok(mut s) = signal(kind) {
            tokio::spawn(async move {
                while s.recv().await.is_some() {
                    eprintln!(
                        "kiln: {name} ignored (settings are read at start; restart the service \
                         to change them)"
                    );
                }
            });
        }
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let term = async {
        match signal(SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = term => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
