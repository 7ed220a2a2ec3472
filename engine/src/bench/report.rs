//! Markdown tables: one run's levels, and several runs side by side with ratios to the first.

use std::fmt::Write;

use super::run::BenchResult;
use super::stats::LevelResult;

fn accept(l: &LevelResult) -> String {
    l.accept_length
        .map(|a| format!("{a:.2}"))
        .unwrap_or_else(|| "-".into())
}

/// Every bench_serving metric of every level of one run.
pub fn table(r: &BenchResult) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| C | ok / failed | req/s | input tok/s | output tok/s | TTFT mean / p50 / p99 ms | TPOT mean / p50 / p99 ms | ITL mean / p50 / p99 ms | E2E mean / p50 / p99 ms | achieved C | accept length |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|");
    for l in &r.levels {
        let _ = writeln!(
            s,
            "| {} | {} / {} | {:.3} | {:.1} | {:.1} | {:.0} / {:.0} / {:.0} | {:.1} / {:.1} / {:.1} | {:.1} / {:.1} / {:.1} | {:.0} / {:.0} / {:.0} | {:.2} | {} |",
            l.concurrency,
            l.completed,
            l.failed,
            l.request_throughput,
            l.input_tok_s,
            l.output_tok_s,
            l.ttft_ms.mean,
            l.ttft_ms.p50,
            l.ttft_ms.p99,
            l.tpot_ms.mean,
            l.tpot_ms.p50,
            l.tpot_ms.p99,
            l.itl_ms.mean,
            l.itl_ms.p50,
            l.itl_ms.p99,
            l.e2e_ms.mean,
            l.e2e_ms.p50,
            l.e2e_ms.p99,
            l.achieved_concurrency,
            accept(l),
        );
    }
    s
}

fn ratio(x: f64, base: f64) -> String {
    if base > 0.0 {
        format!("{:.2}x", x / base)
    } else {
        "-".into()
    }
}

/// Side by side at each concurrency level, the first run as the base of the ratios.
pub fn compare(runs: &[BenchResult]) -> String {
    let mut s = String::new();
    let Some(base) = runs.first() else {
        return s;
    };
    let _ = writeln!(
        s,
        "| C | config | output tok/s | vs {} | TTFT p50 ms | vs {} | TPOT p50 ms | E2E p50 ms | failed | accept length |",
        base.label, base.label
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|");
    let mut levels: Vec<usize> = runs
        .iter()
        .flat_map(|r| r.levels.iter().map(|l| l.concurrency))
        .collect();
    levels.sort_unstable();
    levels.dedup();
    for c in levels {
        let base_level = base.levels.iter().find(|l| l.concurrency == c);
        for r in runs {
            let Some(l) = r.levels.iter().find(|l| l.concurrency == c) else {
                continue;
            };
            let (bo, bt) = base_level
                .map(|b| (b.output_tok_s, b.ttft_ms.p50))
                .unwrap_or((0.0, 0.0));
            let _ = writeln!(
                s,
                "| {} | {} | {:.1} | {} | {:.0} | {} | {:.1} | {:.0} | {} | {} |",
                c,
                r.label,
                l.output_tok_s,
                ratio(l.output_tok_s, bo),
                l.ttft_ms.p50,
                ratio(l.ttft_ms.p50, bt),
                l.tpot_ms.p50,
                l.e2e_ms.p50,
                l.failed,
                accept(l),
            );
        }
    }
    s
}

/// The run with the highest output tok/s at level `c`.
pub fn best_at(runs: &[BenchResult], c: usize) -> Option<&BenchResult> {
    runs.iter()
        .filter_map(|r| {
            let l = r.levels.iter().find(|l| l.concurrency == c)?;
            Some((r, l.output_tok_s))
        })
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(r, _)| r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::BenchSettings;

    fn run(label: &str, tok: &[(usize, f64)]) -> BenchResult {
        BenchResult {
            label: label.into(),
            url: "http://x".into(),
            model: "m".into(),
            settings: BenchSettings::default(),
            started: 0,
            levels: tok
                .iter()
                .map(|&(c, t)| LevelResult {
                    concurrency: c,
                    output_tok_s: t,
                    ..Default::default()
                })
                .collect(),
        }
    }

    #[test]
    fn compare_gives_ratios_to_the_first_run() {
        let a = run("base", &[(1, 100.0), (16, 200.0)]);
        let b = run("spec", &[(1, 150.0), (16, 180.0)]);
        let t = compare(&[a.clone(), b.clone()]);
        assert!(t.contains("| 1 | spec | 150.0 | 1.50x"), "{t}");
        assert!(t.contains("| 16 | spec | 180.0 | 0.90x"), "{t}");
        let runs = [a, b];
        assert_eq!(best_at(&runs, 1).map(|r| r.label.as_str()), Some("spec"));
        assert_eq!(best_at(&runs, 16).map(|r| r.label.as_str()), Some("base"));
        assert!(table(&runs[0]).contains("| 16 | 0 / 0 |"));
    }
}
