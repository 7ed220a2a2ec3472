//! The all-reduce sweep's numbers and what doctor makes of them: latency and bus bandwidth per
//! message size, 4 KiB .. 64 MiB, as NCCL's own `all_reduce_perf` reports them. The lock stores the
//! sweep it was made with; doctor measures again and says when the interconnect got slower (IOMMU
//! or ACS changes after a kernel update, a GPU dropping to a narrower PCIe link, NCCL falling back
//! from peer-to-peer to host copies). The measurement itself needs GPUs and lives in
//! `backend::cuda::nccl_sweep`; everything here is plain arithmetic, tested on the CPU.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{Check, Status, check};

/// Message sizes in bytes: 4 KiB (latency-bound, the decode step's all-reduce of one token's
/// hidden state is ~14 KiB on Kimi-K2) to 64 MiB (bandwidth-bound, long prefills).
pub const SWEEP_BYTES: [u64; 8] = [
    4 << 10,
    16 << 10,
    64 << 10,
    256 << 10,
    1 << 20,
    4 << 20,
    16 << 20,
    64 << 20,
];

/// One message size of a sweep. Integers (ns, MB/s) so a fingerprint stays `Eq` and its JSON exact.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct AllReducePoint {
    pub bytes: u64,
    /// Mean time of one all-reduce, the slowest rank's.
    pub latency_ns: u64,
    /// nccl-tests' bus bandwidth: `bytes / latency * 2 (n - 1) / n`, in MB/s (10^6 bytes).
    pub bus_mbps: u64,
}

impl AllReducePoint {
    /// The point for `bytes` summed across `ranks` ranks in `per_call` (mean over the timed calls).
    pub fn measured(bytes: u64, per_call: Duration, ranks: usize) -> AllReducePoint {
        let secs = per_call.as_secs_f64().max(1e-9);
        let n = ranks.max(1) as f64;
        // Each rank sends and receives 2 (n - 1) / n of the buffer in a ring all-reduce; this
        // factor makes the number comparable to the link's bandwidth whatever the rank count.
        let bus = bytes as f64 / secs * 2.0 * (n - 1.0) / n;
        AllReducePoint {
            bytes,
            latency_ns: per_call.as_nanos().min(u64::MAX as u128) as u64,
            bus_mbps: (bus / 1e6).round() as u64,
        }
    }
}

/// A sweep's points from every rank's mean time per call at each of `sizes`: a collective is as
/// slow as its slowest rank.
pub fn slowest_of(sizes: &[u64], per_rank: &[Vec<Duration>], ranks: usize) -> Vec<AllReducePoint> {
    sizes
        .iter()
        .enumerate()
        .map(|(i, &bytes)| {
            let slowest = per_rank
                .iter()
                .filter_map(|t| t.get(i).copied())
                .max()
                .unwrap_or_default();
            AllReducePoint::measured(bytes, slowest, ranks)
        })
        .collect()
}

/// `4 KiB`, `1 MiB`, ...
pub fn size_label(bytes: u64) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}

/// The sweep as a table: size, latency, bus bandwidth.
pub fn render(points: &[AllReducePoint]) -> String {
    let mut s = format!("{:>8}  {:>12}  {:>10}\n", "size", "latency us", "bus GB/s");
    for p in points {
        s.push_str(&format!(
            "{:>8}  {:>12.1}  {:>10.2}\n",
            size_label(p.bytes),
            p.latency_ns as f64 / 1e3,
            p.bus_mbps as f64 / 1e3
        ));
    }
    s
}

/// The largest sweep size the one-shot kernel is measured at: its inbox holds two slot sets of
/// every rank's message, and past ~1 MiB one block pushing to every peer loses to NCCL's ring.
pub const ONE_SHOT_SWEEP_MAX: u64 = 1 << 20;

/// Which all-reduce serves which message size, from the two sweeps of one machine: the one-shot
/// kernel up to the largest size at which it, and it at every smaller size, beat NCCL by at least
/// 10% (a tie goes to NCCL, the path with more mileage); NCCL above. 0: the one-shot kernel
/// serves nothing (it never won, or was not measured).
pub fn one_shot_max_bytes(nccl: &[AllReducePoint], one_shot: &[AllReducePoint]) -> u64 {
    const MARGIN: f64 = 0.9;
    let mut sizes: Vec<&AllReducePoint> = one_shot.iter().collect();
    sizes.sort_by_key(|p| p.bytes);
    let mut max = 0;
    for p in sizes {
        let Some(n) = nccl.iter().find(|n| n.bytes == p.bytes) else {
            break;
        };
        if (p.latency_ns as f64) < MARGIN * n.latency_ns as f64 {
            max = p.bytes;
        } else {
            break;
        }
    }
    max
}

/// The two sweeps side by side and the choice, for doctor's and the lock's output.
pub fn render_choice(nccl: &[AllReducePoint], one_shot: &[AllReducePoint]) -> String {
    let mut s = format!("{:>8}  {:>10}  {:>14}\n", "size", "NCCL us", "one-shot us");
    for n in nccl {
        let o = one_shot
            .iter()
            .find(|o| o.bytes == n.bytes)
            .map_or("-".to_string(), |o| {
                format!("{:.1}", o.latency_ns as f64 / 1e3)
            });
        s.push_str(&format!(
            "{:>8}  {:>10.1}  {:>14}\n",
            size_label(n.bytes),
            n.latency_ns as f64 / 1e3,
            o
        ));
    }
    match one_shot_max_bytes(nccl, one_shot) {
        0 => s.push_str("serves: NCCL at every size\n"),
        max => s.push_str(&format!(
            "serves: the one-shot kernel up to {}, NCCL above (one-shot-allreduce-max-bytes = {max})\n",
            size_label(max)
        )),
    }
    s
}

/// How much slower than the lock a size may get before doctor says so: noise between runs of the
/// same machine is a few percent; a lost P2P path or a narrower link costs 2x or more.
const WARN_SLOWER: f64 = 1.25;
const FAIL_SLOWER: f64 = 2.0;

/// Doctor's `allreduce` check for a sweep just measured (`now`), against the lock's when there is one.
pub fn compare(now: &[AllReducePoint], locked: &[AllReducePoint]) -> Check {
    let summary = |p: &[AllReducePoint]| {
        let first = p.first().map(|x| {
            format!(
                "{} {:.1} us",
                size_label(x.bytes),
                x.latency_ns as f64 / 1e3
            )
        });
        let last = p.last().map(|x| {
            format!(
                "{} {:.2} GB/s bus",
                size_label(x.bytes),
                x.bus_mbps as f64 / 1e3
            )
        });
        [first, last]
            .into_iter()
            .flatten()
            .collect::<Vec<_>>()
            .join(", ")
    };
    if now.is_empty() {
        return check(
            "allreduce",
            Status::Fail,
            "the sweep returned no sizes",
            None,
        );
    }
    // The worst slowdown over the sizes both sweeps have, by time per call (for one size, time and
    // bus bandwidth move together).
    let worst = now
        .iter()
        .filter_map(|p| {
            let l = locked.iter().find(|l| l.bytes == p.bytes)?;
            let slower = p.latency_ns as f64 / (l.latency_ns.max(1)) as f64;
            Some((slower, p, l))
        })
        .max_by(|a, b| a.0.total_cmp(&b.0));
    match worst {
        Some((slower, p, l)) if slower >= WARN_SLOWER => {
            let status = if slower >= FAIL_SLOWER {
                Status::Fail
            } else {
                Status::Warn
            };
            check(
                "allreduce",
                status,
                format!(
                    "{} all-reduce takes {:.1} us, {slower:.2}x the locked {:.1} us ({:.2} vs {:.2} GB/s bus)",
                    size_label(p.bytes),
                    p.latency_ns as f64 / 1e3,
                    l.latency_ns as f64 / 1e3,
                    p.bus_mbps as f64 / 1e3,
                    l.bus_mbps as f64 / 1e3,
                ),
                Some(
                    "check `nvidia-smi topo -m` and the PCIe link widths (`nvidia-smi -q | grep -A2 'Link Width'`), iommu=pt and ACS, and NCCL_DEBUG=INFO for a transport other than P2P; re-lock if the change is intended",
                ),
            )
        }
        Some(_) => check(
            "allreduce",
            Status::Pass,
            format!("{} (within {WARN_SLOWER}x of the lock)", summary(now)),
            None,
        ),
        None => check("allreduce", Status::Pass, summary(now), None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sweep_point_is_its_slowest_rank() {
        let us = Duration::from_micros;
        let per_rank = [vec![us(10), us(50)], vec![us(30), us(40)]];
        let p = slowest_of(&[4096, 65536], &per_rank, 2);
        assert_eq!(p[0].latency_ns, 30_000);
        assert_eq!(p[1].latency_ns, 50_000);
    }

    #[test]
    fn bus_bandwidth_follows_nccl_tests() {
        // 64 MiB in 10 ms on 8 ranks: algbw 6.71 GB/s, busbw = algbw * 14 / 8 = 11.74 GB/s.
        let p = AllReducePoint::measured(64 << 20, Duration::from_millis(10), 8);
        assert_eq!(p.latency_ns, 10_000_000);
        assert_eq!(p.bus_mbps, 11744);
        // One rank moves nothing over a bus.
        assert_eq!(
            AllReducePoint::measured(4096, Duration::from_micros(5), 1).bus_mbps,
            0
        );
    }

    fn sweep(scale: f64) -> Vec<AllReducePoint> {
        SWEEP_BYTES
            .iter()
            .map(|&b| {
                let t = 20e-6 + b as f64 / 20e9;
                AllReducePoint::measured(b, Duration::from_secs_f64(t * scale), 8)
            })
            .collect()
    }

    fn points(latency_us: &[(u64, f64)]) -> Vec<AllReducePoint> {
        latency_us
            .iter()
            .map(|&(b, us)| AllReducePoint::measured(b, Duration::from_secs_f64(us * 1e-6), 8))
            .collect()
    }

    #[test]
    fn the_one_shot_kernel_serves_the_sizes_where_it_clearly_wins() {
        let nccl = points(&[
            (4 << 10, 30.0),
            (16 << 10, 32.0),
            (64 << 10, 40.0),
            (256 << 10, 70.0),
        ]);
        // PCIe box: the one-shot wins below 64 KiB, loses above (it pushes 7 copies).
        let one_shot = points(&[
            (4 << 10, 7.0),
            (16 << 10, 12.0),
            (64 << 10, 41.0),
            (256 << 10, 150.0),
        ]);
        assert_eq!(one_shot_max_bytes(&nccl, &one_shot), 16 << 10);
        let table = render_choice(&nccl, &one_shot);
        assert!(table.contains("up to 16 KiB"), "{table}");
        // Within 10% is a tie, and a tie goes to NCCL.
        let close = points(&[(4 << 10, 28.0)]);
        assert_eq!(one_shot_max_bytes(&nccl, &close), 0);
        // A win above a loss does not count: the choice is one threshold.
        let odd = points(&[(4 << 10, 40.0), (16 << 10, 10.0)]);
        assert_eq!(one_shot_max_bytes(&nccl, &odd), 0);
        // Not measured: NCCL everywhere.
        assert_eq!(one_shot_max_bytes(&nccl, &[]), 0);
        assert!(render_choice(&nccl, &[]).contains("NCCL at every size"));
        // A one-shot size NCCL was not measured at ends the comparison.
        assert_eq!(one_shot_max_bytes(&[], &one_shot), 0);
    }

    #[test]
    fn doctor_flags_a_slower_interconnect_by_how_much() {
        let locked = sweep(1.0);
        assert_eq!(compare(&sweep(1.1), &locked).status, Status::Pass);
        assert_eq!(compare(&sweep(1.5), &locked).status, Status::Warn);
        let bad = compare(&sweep(3.0), &locked);
        assert_eq!(bad.status, Status::Fail, "{}", bad.detail);
        assert!(bad.detail.contains("3.00x"), "{}", bad.detail);
        // Only the large sizes slowed down (P2P lost, host copies instead): still caught.
        let mut now = sweep(1.0);
        for p in now.iter_mut().filter(|p| p.bytes >= 1 << 20) {
            *p = AllReducePoint::measured(p.bytes, Duration::from_nanos(p.latency_ns * 4), 8);
        }
        let c = compare(&now, &locked);
        assert_eq!(c.status, Status::Fail);
        assert!(c.detail.contains("MiB"), "{}", c.detail);
        // No lock to compare with: a pass that reports the sweep.
        let c = compare(&sweep(1.0), &[]);
        assert_eq!(c.status, Status::Pass);
        assert!(c.detail.contains("4 KiB") && c.detail.contains("64 MiB"));
        assert!(render(&locked).contains("64 MiB"));
    }
}
