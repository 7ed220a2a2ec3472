//! `kiln gpu-check` (built with `--features cuda`): every CUDA kernel against its CPU reference on
//! device 0, then every op of the CUDA backend against the CPU backend through the op trait, fresh
//! random inputs each run, then the NCCL all-reduce sweep over every visible GPU and the one-shot
//! all-reduce's protocol over 4 ranks (bit-exact sums), and one Kimi-K2-sized MoE layer timed at
//! batch 1, 8, 64 and 128 with each expert kernel (FMAs, tensor cores) beside its memory roofline;
//! tables on stdout, JSON with `--json`, non-zero exit on any mismatch or a failed sweep. `engine/benches/gpu-check.sh` runs it on a lent GPU machine.

use std::path::PathBuf;

use anyhow::Context;
use kiln::runner::measure::gpu;

#[derive(clap::Args)]
pub struct GpuCheckArgs {
    /// Also write the results here as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Seed of the random inputs [default: from the clock, printed].
    #[arg(long)]
    seed: Option<u64>,
    /// Leave out the Kimi-K2-sized MoE layer's timing (about 9 GB of weights; it measures a
    /// GPU's bandwidth, so it means nothing on the simulated GPU the CPU tests use).
    #[arg(long)]
    skip_moe_layer: bool,
}

pub fn run(a: GpuCheckArgs) -> anyhow::Result<()> {
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0)
    });
    println!("seed {seed}");
    let results = gpu::parity(seed).context("the CUDA kernels and backend against the CPU")?;
    println!(
        "{:<16} {:<44} {:>10} {:>9}  result",
        "op", "case", "error", "tolerance"
    );
    for r in &results {
        println!(
            "{:<16} {:<44} {:>10.3e} {:>9.1e}  {}",
            r.op,
            r.case,
            r.error,
            r.tolerance,
            if r.pass { "pass" } else { "FAIL" }
        );
    }
    // The NCCL all-reduce sweep over every visible GPU (one rank on a one-GPU machine: no bus
    // traffic, but the same init, buffers and timing code `kiln doctor` runs on the 8-GPU box).
    let gpus = gpu::count();
    let sweep = kiln::runner::measure::allreduce_sweep(gpus);
    match &sweep {
        Ok(points) => print!(
            "\nall-reduce sweep over {gpus} GPU(s)\n{}",
            kiln::doctor::allreduce::render(points)
        ),
        Err(e) => println!("\nall-reduce sweep over {gpus} GPU(s) failed: {e}"),
    }
    // The one-shot kernel's protocol over 4 ranks on whatever GPUs there are (several ranks per
    // GPU on a one-GPU machine): real launches, flags and parities, every sum checked.
    let one_shot = gpu::one_shot_selftest(4, 300, seed);
    match &one_shot {
        Ok(line) => println!("\n{line}"),
        Err(e) => println!("\none-shot all-reduce FAILED: {e}"),
    }
    // One Kimi-K2-sized MoE layer (issue 28's target: batch 1 at >= 70% of the roofline).
    let moe = if a.skip_moe_layer {
        Ok((Vec::new(), None))
    } else {
        gpu::kimi_moe_layer(seed)
    };
    match &moe {
        Ok(_) if a.skip_moe_layer => println!("\nKimi-K2 MoE layer: left out (--skip-moe-layer)"),
        Ok((points, bw)) => print!(
            "\nKimi-K2 MoE layer (384 INT4 experts of 7168 x 2048, 8 a token; roofline at {})\n{}",
            bw.map_or("an unreported bandwidth".into(), |b| format!(
                "{:.0} GB/s, the driver's clock x bus width",
                b / 1e9
            )),
            kiln::bench::moe_layer::render(points, *bw)
        ),
        Err(e) => println!("\nKimi-K2 MoE layer FAILED: {e}"),
    }
    if let Some(p) = &a.json {
        let sweep = match &sweep {
            Ok(points) => serde_json::json!({ "gpus": gpus, "points": points }),
            Err(e) => serde_json::json!({ "gpus": gpus, "error": e }),
        };
        let one_shot = match &one_shot {
            Ok(line) => serde_json::json!({ "pass": true, "detail": line }),
            Err(e) => serde_json::json!({ "pass": false, "detail": e }),
        };
        let moe_layer = match &moe {
            Ok((points, bw)) => serde_json::json!({ "points": points, "peak_read_bandwidth": bw }),
            Err(e) => serde_json::json!({ "error": e.to_string() }),
        };
        let body = serde_json::json!({ "seed": seed, "ops": results, "allreduce": sweep, "one_shot": one_shot, "moe_layer": moe_layer });
        std::fs::write(p, serde_json::to_string_pretty(&body)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    let failed = results.iter().filter(|r| !r.pass).count();
    anyhow::ensure!(failed == 0, "{failed} of {} cases failed", results.len());
    sweep.map_err(|e| anyhow::anyhow!("all-reduce sweep: {e}"))?;
    one_shot.map_err(|e| anyhow::anyhow!("one-shot all-reduce: {e}"))?;
    moe.map_err(|e| anyhow::anyhow!("Kimi-K2 MoE layer: {e}"))?;
    Ok(())
}
