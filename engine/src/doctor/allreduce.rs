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
