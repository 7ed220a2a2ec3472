#!/usr/bin/env python3
"""Decode tok/s of a small random DeepSeek-V3-architecture model (MLA + MoE): kiln vs transformers.

Builds one random `DeepseekV3ForCausalLM` (hidden 512, 6 layers of which the first is dense, 8
heads, kv_lora_rank 128, q_lora_rank 192, qk 64+32, v 64, 32 routed experts of 256 in 8 groups,
4 groups and 4 experts per token, 1 shared expert, vocab 8192, float32) with transformers, saves it
with a word-level tokenizer, then times greedy decoding of 64 tokens after a 32-token prompt:
transformers `generate` (KV cache, eager attention, torch threads = --threads) and `kiln generate
--mode exact` (f32, the same arithmetic class) on the same directory, interleaved for --rounds.
Decode rate = (time for 65 new tokens - time for 1) / 64 on both sides, so prefill and load are out.

    /path/to/venv/bin/python engine/benches/deepseek_vs_transformers.py [--kiln target/release/kiln]
Needs torch, transformers >= 5, tokenizers; writes to a temporary directory only.
"""

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, models
from transformers import AutoModelForCausalLM, DeepseekV3Config

VOCAB = 8192


def build(d: Path):
    cfg = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
        num_hidden_layers=6, first_k_dense_replace=1, num_attention_heads=8, num_key_value_heads=8,
        n_shared_experts=1, n_routed_experts=32, num_experts_per_tok=4, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, kv_lora_rank=128, q_lora_rank=192, qk_rope_head_dim=32,
        qk_nope_head_dim=64, v_head_dim=64, max_position_embeddings=4096,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 1024, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    model.save_pretrained(d)
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0")).save(str(d / "tokenizer.json"))
    return model


def hf_time(model, prompt, new):
    ids = torch.tensor([prompt])
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return time.perf_counter() - t0


def kiln_time(kiln, d, prompt, new, threads):
    cmd = [kiln, "generate", "--model", str(d), "--mode", "exact", "--threads", str(threads),
           "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", str(new), "--ignore-eos", "--json"]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return time.perf_counter() - t0, out.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", default="target/release/kiln")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        model = build(d)
        prompt = list(range(100, 132))
        print("| round | transformers decode tok/s | kiln decode tok/s | ratio |")
        print("|---|---|---|---|")
        for r in range(a.rounds):
            hf = 64 / (hf_time(model, prompt, 65) - hf_time(model, prompt, 1))
            k65, _ = kiln_time(a.kiln, d, prompt, 65, a.threads)
            k1, _ = kiln_time(a.kiln, d, prompt, 1, a.threads)
            kiln = 64 / (k65 - k1)
            print(f"| {r + 1} | {hf:.1f} | {kiln:.1f} | {kiln / hf:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
