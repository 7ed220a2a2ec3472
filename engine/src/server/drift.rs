//! A served lock's drift: the start-up checks and the canary benchmark, published in /metrics
//! (`kiln_lock_drift{check}`, `kiln_canary_ratio`) and in /ready's body.

use std::sync::atomic::Ordering;

use crate::doctor::{Check, Status};
use crate::metrics::CheckLabels;
use crate::server::state::{AppState, Canary};

/// Records checks: failing ones as drift (gauge 1), passing ones as 0; warnings and failures are
/// listed by /ready.
pub fn publish_checks(state: &AppState, checks: &[Check]) {
    let mut shown = state.drift.lock().unwrap_or_else(|p| p.into_inner());
    for c in checks {
        let bad = c.status == Status::Fail;
        state
            .metrics
            .lock_drift
            .get_or_create(&CheckLabels {
                check: c.name.clone(),
            })
            .set(i64::from(bad));
        if matches!(c.status, Status::Fail | Status::Warn) {
            shown.retain(|x| x.name != c.name);
            shown.push(c.clone());
        }
    }
}

/// Runs the canary against this server; true when it is within tolerance of the lock.
pub async fn run_canary(state: &AppState, canary: &Canary, url: &str) -> bool {
    state.canary_running.store(true, Ordering::SeqCst);
    let model = state.ready.get().map(|r| r.model_id.clone());
    let result = match crate::bench::prompts::load(&canary.settings.dataset) {
        Ok(prompts) => {
            crate::bench::run::run(
                "canary",
                url,
                model,
                state.opts.api_key.clone(),
                &canary.settings,
                &prompts,
                |_| std::sync::Arc::new(|_, _| {}),
            )
            .await
        }
        Err(e) => Err(e),
    };
    let floor = canary.expected_tok_s * (1.0 - canary.tolerance);
    let check = match result.as_ref().map(|r| r.levels.first()) {
        Ok(Some(level)) => {
            let ratio = if canary.expected_tok_s > 0.0 {
                level.output_tok_s / canary.expected_tok_s
            } else {
                0.0
            };
            state.metrics.canary_ratio.set(ratio);
            let detail = format!(
                "{:.1} output tok/s at C={}, locked {:.1} ({:.2}x, floor {:.1}); {} failed requests",
                level.output_tok_s,
                level.concurrency,
                canary.expected_tok_s,
                ratio,
                floor,
                level.failed
            );
            let pass = level.output_tok_s >= floor && level.failed == 0;
            Check {
                name: "canary".into(),
                status: if pass { Status::Pass } else { Status::Fail },
                detail,
                fix: (!pass).then(|| {
                    "the machine no longer reaches the locked throughput: check `kiln doctor --lock`, load from other processes, then re-run the sweep".to_string()
                }),
            }
        }
        Ok(None) => Check {
            name: "canary".into(),
            status: Status::Fail,
            detail: "the canary ran no level".into(),
            fix: None,
        },
        Err(e) => Check {
            name: "canary".into(),
            status: Status::Fail,
            detail: format!("the canary could not run: {e}"),
            fix: None,
        },
    };
    if check.status == Status::Pass {
        eprintln!("kiln: canary passed: {}", check.detail);
    } else {
        eprintln!("kiln: canary FAILED: {}", check.detail);
    }
    let pass = check.status == Status::Pass;
    publish_checks(state, std::slice::from_ref(&check));
    state.canary_running.store(false, Ordering::SeqCst);
    pass
}
