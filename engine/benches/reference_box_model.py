#!/usr/bin/env python3
"""A performance model of the reference box: Kimi-K2-Thinking (INT4 experts) on 8x RTX PRO 6000
Blackwell over PCIe, decode step time and output tok/s at C = 1, 30, 32 and 100, baseline and
EAGLE-3, for kiln as built and with its known gaps closed. No dependencies; prints the markdown
tables docs/reference-box-model.md quotes.

    python3 engine/benches/reference_box_model.py [--context 2048] [--accept 2.5] [--json]

Every input is a named constant below, each marked with where it comes from:
  DATASHEET  the GPU's and the model's published figures;
  ISSUE      figures the project was given (all-reduce latencies on the reference box, peers);
  ASSUMED    an estimate that waits for a measurement (`kiln gpu-check` on a lent GPU reports the
             roofline fraction of kiln's kernels; `kiln doctor` on the box measures both
             all-reduces) -- replace them with the measured values and re-run.
"""

import argparse
import functools
import json
import random

# --- The machine (DATASHEET) ---------------------------------------------------------------------
GPUS = 8
HBM_BW = 1.792e12  # bytes/s per GPU: RTX PRO 6000 Blackwell, 96 GB GDDR7, 512-bit at 28 Gbps
BF16_FLOPS = 500e12  # dense bf16 tensor-core peak per GPU (fp32 accumulate), 1/8 of the FP4 sparse

# --- Kernel efficiency (ASSUMED until the device check measures kiln's kernels) --------------------
ETA_DENSE = 0.75  # bf16 GEMV/skinny GEMM through cuBLASLt, fraction of HBM_BW
ETA_EXPERT = 0.60  # kiln's packed INT4 matmul (warp per row, 8 tokens per pass), fraction of HBM_BW
ETA_FLOPS = 0.50  # fraction of BF16_FLOPS a skinny GEMM sustains when compute-bound

# --- All-reduce over PCIe Gen5 without NVLink (ISSUE; kiln doctor measures them on the box) ------
NCCL_LATENCY = 35e-6  # 25-50 us per small message across 8 PCIe GPUs
NCCL_BUS_BW = 25e9  # bus bandwidth of NCCL's ring over PCIe (bytes/s)
ONE_SHOT_LATENCY = 7.5e-6  # 6-9 us per small message, one-shot peer-to-peer kernel
ONE_SHOT_LINK_BW = 40e9  # each GPU pushes (GPUS - 1) copies over its x16 link (ASSUMED)
# A host wait after every collective idles the GPU for a launch's latency (ASSUMED ~7 us). kiln
# waited so until its collectives moved under a watchdog thread (2026-12-07); kept to show the cost.
HOST_SYNC_BUBBLE = 7e-6

# --- Kimi-K2 (DATASHEET: config.json of moonshotai/Kimi-K2-Thinking) ----------------------------
LAYERS, DENSE_LAYERS = 61, 1
HIDDEN, HEADS = 7168, 64
Q_LORA, KV_LORA, QK_NOPE, QK_ROPE, V_HEAD = 1536, 512, 128, 64, 128
EXPERTS, TOP_K, MOE_INTER, SHARED_EXPERTS = 384, 8, 2048, 1
DENSE_INTER, VOCAB = 18432, 163840
INT4_BYTES_PER_PARAM = 0.5 + 2 / 32  # 4-bit values and a bf16 scale per group of 32
BF16 = 2

# --- EAGLE-3 head (SGLang's layout for a 7168-wide target; DATASHEET of such heads) --------------
DRAFT_VOCAB = 32000
DRAFT_PARAMS = (
    3 * HIDDEN * HIDDEN  # fc: three captured hidden states -> one
    + 2 * HIDDEN * HIDDEN + 2 * 2 * HIDDEN * 1024 + HIDDEN * HIDDEN  # q (2H input), k, v, o
    + 3 * HIDDEN * DENSE_INTER  # the MLP
    + DRAFT_VOCAB * HIDDEN  # the draft LM head
)
DRAFT_STEPS = 3  # chain of 3, as SGLang's reference setup

# --- The peers (ISSUE) ----------------------------------------------------------------------------
SGLANG = {"baseline": {1: 92.7, 30: 689.4, 100: 773.1}, "eagle3": {1: 86.8, 30: 759.3, 100: 775.0}}
VLLM_K26 = {"baseline": {1: 86.9, 32: 857.0}, "eagle3": {1: 117.1, 32: 1150.0}}
TARGETS = {1: 130.0, 32: 1300.0}


def attention_params():
    """Per layer: (replicated on every rank, split by heads across ranks)."""
    replicated = HIDDEN * Q_LORA + HIDDEN * (KV_LORA + QK_ROPE)  # q_a, kv_a (with the rope key)
    split = Q_LORA * HEADS * (QK_NOPE + QK_ROPE) + KV_LORA * HEADS * (QK_NOPE + V_HEAD)
    split += HEADS * V_HEAD * HIDDEN  # o_proj
    return replicated, split


def shared_bytes_per_gpu(split_lm_head):
    """Weights every step reads whatever the batch, per GPU (bf16)."""
    rep, split = attention_params()
    moe_layers = LAYERS - DENSE_LAYERS
    params = LAYERS * (rep + split / GPUS)
    params += moe_layers * SHARED_EXPERTS * 3 * HIDDEN * MOE_INTER / GPUS
    params += moe_layers * HIDDEN * EXPERTS  # the router, whole on every rank
    params += DENSE_LAYERS * 3 * HIDDEN * DENSE_INTER / GPUS
    # Split by vocabulary (kiln since 2026-12-07: each rank its slice of the logits, then a gather).
    params += VOCAB * HIDDEN / (GPUS if split_lm_head else 1)
    return params * BF16


EXPERT_BYTES = 3 * HIDDEN * MOE_INTER * INT4_BYTES_PER_PARAM


@functools.lru_cache(maxsize=None)
def expert_loads(tokens, expert_parallel, trials=200, seed=7):
    """Mean over random uniform routings of the busiest GPU's expert reads per layer, in experts.
    Expert-parallel: each GPU holds 48 whole experts and reads those its tokens picked; split:
    each GPU reads 1/8 of every picked expert. Real routing is skewed (hot experts), which
    helps the distinct count and hurts the balance; uniform is the neutral case."""
    rng = random.Random(seed + tokens)
    per_gpu = EXPERTS // GPUS
    total = 0.0
    for _ in range(trials):
        picked = set()
        for _ in range(tokens):
            picked.update(rng.sample(range(EXPERTS), TOP_K))
        if expert_parallel:
            counts = [0] * GPUS
            for e in picked:
                counts[e // per_gpu] += 1
            total += max(counts)
        else:
            total += len(picked) / GPUS
    return total / trials


def all_reduce_time(message_bytes, one_shot, bubble):
    ring = NCCL_LATENCY + 2 * (GPUS - 1) / GPUS * message_bytes / NCCL_BUS_BW
    t = ring
    if one_shot:
        # The lock's choice: whichever is faster at this size.
        t = min(ring, ONE_SHOT_LATENCY + (GPUS - 1) * message_bytes / ONE_SHOT_LINK_BW)
    return t + (HOST_SYNC_BUBBLE if bubble else 0.0)


def forward_time(tokens, sequences, context, v):
    """One target forward over `tokens` tokens of `sequences` sequences, seconds, by part."""
    moe_layers = LAYERS - DENSE_LAYERS
    shared = shared_bytes_per_gpu(v["split_lm_head"]) / (HBM_BW * ETA_DENSE)
    experts_ep = v["expert_parallel"](tokens)
    experts = expert_loads(tokens, experts_ep) * EXPERT_BYTES * moe_layers / (HBM_BW * ETA_EXPERT)
    # The MLA latent (512 + 64 values per token and layer) is whole on every rank: each GPU reads
    # every sequence's cache once per step for its 8 heads.
    kv = sequences * context * (KV_LORA + QK_ROPE) * BF16 * LAYERS / (HBM_BW * ETA_DENSE)
    # Compute: about 2 FLOP per active parameter per token (32B active), split over the GPUs,
    # plus the absorbed attention over the context.
    attn_flops = tokens * context * HEADS / GPUS * (KV_LORA + QK_ROPE + KV_LORA) * 2 * LAYERS
    flops = tokens * 2 * 32.6e9 / GPUS + attn_flops
    compute = flops / (BF16_FLOPS * ETA_FLOPS)
    memory = shared + experts + kv
    collective = 2 * LAYERS * all_reduce_time(tokens * HIDDEN * BF16, v["one_shot"], v["bubble"])
    return {
        "shared": shared,
        "experts": experts,
        "kv": kv,
        "compute": compute,
        # Memory and compute overlap within the kernels; the collectives sit between them.
        "all_reduce": collective,
        "total": max(memory, compute) + collective,
    }


def draft_time(sequences, v):
    """One EAGLE-3 draft step for `sequences` sequences. Split (kiln since 2026-12-07): every rank
    reads 1/8 of the head, then the attention's and the MLP's all-reduces and the gather of the
    draft logits (charged as a third small collective; the extend's fc adds a fourth, once per
    step, which this per-draft-step figure leaves out). Whole: rank 0 reads all of it."""
    if v["split_draft"]:
        weights = DRAFT_PARAMS * BF16 / GPUS / (HBM_BW * ETA_DENSE)
        return weights + 3 * all_reduce_time(sequences * HIDDEN * BF16, v["one_shot"], v["bubble"])
    return DRAFT_PARAMS * BF16 / (HBM_BW * ETA_DENSE)


def position_acceptance(accept, k=DRAFT_STEPS):
    """The per-position acceptance a for which a chain of k gives `accept` tokens per verify
    (1 + a + ... + a^k, each draft accepted only after the one before it)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(k + 1)) < accept:
            lo = mid
        else:
            hi = mid
    return lo


def step(c, context, accept, spec, v):
    """Output tok/s at concurrency c, and the step's parts. EAGLE-3 takes the chain length K <=
    DRAFT_STEPS that serves most, as kiln's adaptive policy picks K per step from measured costs
    and acceptance (`accept` is the chain of DRAFT_STEPS's tokens per verify; shorter chains
    accept the same per position)."""
    if not spec:
        f = forward_time(c, c, context, v)
        return c / f["total"], dict(f, k=0)
    a = position_acceptance(accept)
    best = None
    for k in range(1, DRAFT_STEPS + 1):
        f = forward_time(c * (k + 1), c, context, v)
        drafting = k * draft_time(c, v)
        total = f["total"] + drafting
        tps = c * sum(a**i for i in range(k + 1)) / total
        if best is None or tps > best[0]:
            best = (tps, dict(f, drafting=drafting, total=total, k=k))
    return best


VARIANTS = {
    "kiln before 2026-12-07 (head whole on rank 0)": {
        # What the head's split replaced: --moe-split columns, the EAGLE-3 head whole on rank 0.
        "expert_parallel": lambda tokens: False,
        "split_lm_head": True,
        "one_shot": True,
        "bubble": False,
        "split_draft": False,
    },
    "kiln as built": {
        # Expert-parallel experts (the default --moe-split), the LM head split by vocabulary, the
        # EAGLE-3 head split across the ranks.
        "expert_parallel": lambda tokens: True,
        "split_lm_head": True,
        "one_shot": True,
        "bubble": False,
        "split_draft": True,
    },
    "kiln as built, --moe-split columns": {
        "expert_parallel": lambda tokens: False,
        "split_lm_head": True,
        "one_shot": True,
        "bubble": False,
        "split_draft": True,
    },
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=2048, help="mean tokens in context per sequence")
    ap.add_argument("--accept", type=float, default=2.5, help="EAGLE-3 tokens per verify (chain of 3)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    levels = [1, 30, 32, 100]
    rows = []
    for name, v in VARIANTS.items():
        for c in levels:
            base, bf = step(c, a.context, a.accept, False, v)
            spec, sf = step(c, a.context, a.accept, True, v)
            rows.append({"variant": name, "c": c, "baseline": base, "eagle3": spec,
                         "served": max(base, spec), "baseline_parts": bf, "eagle3_parts": sf})
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    ms = lambda s: f"{s * 1e3:.1f}"
    print(f"context {a.context} tokens, EAGLE-3 {a.accept} tokens per verify (chain of {DRAFT_STEPS})\n")
    print("| variant | C | step ms: weights / experts / KV / all-reduce | baseline tok/s | EAGLE-3 K | EAGLE-3 step ms | EAGLE-3 tok/s | served (adaptive) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        p = r["baseline_parts"]
        parts = " / ".join(ms(p[k]) for k in ("shared", "experts", "kv", "all_reduce"))
        print(f"| {r['variant']} | {r['c']} | {parts} = {ms(p['total'])} | {r['baseline']:.0f} | "
              f"{r['eagle3_parts']['k']} | {ms(r['eagle3_parts']['total'])} | {r['eagle3']:.0f} | "
              f"{r['served']:.0f} |")
    print("\n| C | SGLang baseline | SGLang EAGLE-3 | vLLM (K2.6) baseline | vLLM (K2.6) EAGLE-3 | target |")
    print("|---|---|---|---|---|---|")
    for c in levels:
        g = lambda d, k: f"{d[k][c]:.1f}" if c in d[k] else "-"
        t = f"{TARGETS[c]:.0f}" if c in TARGETS else "-"
        print(f"| {c} | {g(SGLANG, 'baseline')} | {g(SGLANG, 'eagle3')} | {g(VLLM_K26, 'baseline')} | "
              f"{g(VLLM_K26, 'eagle3')} | {t} |")
    # How the served figure with the gaps closed moves with the inputs that are least known.
    global ETA_EXPERT, NCCL_BUS_BW
    saved = (ETA_EXPERT, NCCL_BUS_BW)
    closed = VARIANTS["kiln as built, --moe-split columns"]
    print("\nAs built with --moe-split columns, served tok/s (adaptive: the better of baseline and EAGLE-3) as the least-known inputs move:\n")
    print("| INT4 expert kernel (of bandwidth) | NCCL bus GB/s | EAGLE-3 tokens per verify | C = 1 | C = 32 | C = 100 |")
    print("|---|---|---|---|---|---|")
    for eta in (0.6, 0.8, 1.0):
        for bus in (25e9, 50e9):
            for accept in (2.0, 2.5, 3.0):
                ETA_EXPERT, NCCL_BUS_BW = eta, bus
                served = [max(step(c, a.context, accept, s, closed)[0] for s in (False, True)) for c in (1, 32, 100)]
                print(f"| {eta:.1f} | {bus / 1e9:.0f} | {accept} | " + " | ".join(f"{x:.0f}" for x in served) + " |")
    ETA_EXPERT, NCCL_BUS_BW = saved


if __name__ == "__main__":
    main()
