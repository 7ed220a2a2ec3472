#!/usr/bin/env python3
"""Build tiny, randomly initialised HF models and their reference logits, for kiln's tests.

We have no real weights for some architectures kiln supports, so this script makes tiny ones
(vocab 512, hidden 64, intermediate 128, 2 layers, 4 query heads, 2 KV heads) with
transformers itself, saves them the way the Hub ships checkpoints (config.json +
model.safetensors, or shards + model.safetensors.index.json) and records what transformers
computes with them, so kiln's loader and forward pass can be checked against it.

What it writes
--------------
  engine/tests/fixtures/tiny/<name>/config.json, model.safetensors      (float32, one file)
  engine/tests/fixtures/tiny/llama-bf16-sharded/config.json,
      model-0000N-of-0000M.safetensors, model.safetensors.index.json    (bfloat16, sharded)
  engine/tests/fixtures/tiny-models.json

for the models
  llama3              LlamaConfig, rope_type "llama3" (theta 5e5, factor 8, low/high freq factor 1/4,
                      original_max_position_embeddings 64, so that with head_dim 16 the RoPE
                      frequencies fall in all three llama3 bands: unchanged, smoothed, divided), untied
  mistral             MistralConfig, sliding_window None, rope theta 1e6, untied
  qwen2               Qwen2Config, non-zero random q/k/v biases, tied embeddings
  qwen3               Qwen3Config, head_dim 32 (q width 128 != hidden 64), random q_norm/k_norm, tied
  llama-bf16-sharded  plain LlamaConfig, saved in bfloat16 with max_shard_size="100KB"

Weights: torch.manual_seed per model, then every matrix / embedding ~ N(0, WEIGHT_STD^2) (0.2 rather
than the 0.02 default, so that the logits are well separated), biases ~ N(0, BIAS_STD^2), and every
RMSNorm weight (input/post-attention/final norms, q_norm/k_norm) = 1 + 0.1 * N(0, 1), so that norm
weights are actually exercised. Models are float32, eval mode, eager attention, torch.no_grad.

tiny-models.json holds {"transformers", "torch", "models": [...]} with per model:
  name, dir (relative to engine/tests/fixtures), dtype (of the saved weights),
  prompt_seed  the torch.Generator seed of the prompt: the first of seed*100, seed*100+1, ...
               whose 16 greedy margins are all >= 0.05 (seed = the model's torch.manual_seed),
  prompt_ids   24 ids in [3, 512), torch.randint(3, 512, (24,), generator=that generator),
  greedy_ids   16 greedy continuation ids (manual argmax loop, full forward over the whole sequence
               every step, no KV cache, never stopping),
  margins      top1 - top2 logit at each greedy step,
  last_logits  all 512 logits at the last prompt position (rounded to 6 decimals),
  mid_logits   all 512 logits at prompt position 10 (0-based), same rounding.
For llama-bf16-sharded the reference is the saved bf16 checkpoint loaded back and upcast to float32
(.float()), run in float32.

After saving, every directory is reloaded with AutoModelForCausalLM.from_pretrained and must
reproduce the recorded logits (guards against a save/load mismatch); the script fails otherwise.

How to run
----------
    HF_HUB_OFFLINE=1 python3 engine/tests/reference/make_tiny_models.py \
        [--out-dir engine/tests/fixtures]

Needs torch and transformers only (no network, no downloads). The fixtures in the repository were
made with transformers 5.24.0 and torch 2.15.0 (CPU, 1 thread); the versions are recorded in
tiny-models.json.

Note on transformers 5.x: config.json stores RoPE settings as "rope_parameters" (with "rope_theta"
inside it) instead of the older top-level "rope_theta" / "rope_scaling"; `safe_serialization` is no
longer a save_pretrained argument (safetensors is always used), so it is not passed.
"""

import argparse
import json
import math
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

torch.set_num_threads(1)

VOCAB = 512
PROMPT_LEN = 24
GREEDY_STEPS = 16
MID_POS = 10
WEIGHT_STD = 0.2
BIAS_STD = 0.1
NORM_STD = 0.1
MIN_MARGIN = 0.05
MAX_PROMPT_TRIES = 200

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.02,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=None,
)


def model_specs():
    """(name, seed, config, save dtype, max_shard_size)."""
    return [
        (
            "llama3",
            101,
            LlamaConfig(
                **COMMON,
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
                tie_word_embeddings=False,
            ),
            torch.float32,
            None,
        ),
        (
            "mistral",
            102,
            MistralConfig(
                **COMMON,
                sliding_window=None,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                tie_word_embeddings=False,
            ),
            torch.float32,
            None,
        ),
        (
            "qwen2",
            103,
            Qwen2Config(
                **COMMON,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                tie_word_embeddings=True,
            ),
            torch.float32,
            None,
        ),
        (
            "qwen3",
            104,
            Qwen3Config(
                **COMMON,
                head_dim=32,
                attention_bias=False,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                tie_word_embeddings=True,
            ),
            torch.float32,
            None,
        ),
        (
            "llama-bf16-sharded",
            105,
            LlamaConfig(**COMMON, tie_word_embeddings=False),
            torch.bfloat16,
            "100KB",
        ),
    ]


def randomise(model):
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied parameters are listed once
            if "norm" in name:
                p.copy_(1.0 + NORM_STD * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(BIAS_STD * torch.randn_like(p))
            else:
                p.copy_(WEIGHT_STD * torch.randn_like(p))


@torch.no_grad()
def logits_of(model, ids):
    out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False)
    return out.logits[0].float()  # [seq, vocab]


@torch.no_grad()
def reference(model, prompt):
    full = logits_of(model, prompt)
    ids = list(prompt)
    greedy, margins = [], []
    for _ in range(GREEDY_STEPS):
        last = logits_of(model, ids)[-1]
        top = torch.topk(last, 2)
        nxt = int(top.indices[0])
        greedy.append(nxt)
        margins.append(float(top.values[0] - top.values[1]))
        ids.append(nxt)
    return full, greedy, margins


def keep_only(directory: Path):
    for f in directory.iterdir():
        if f.name == "config.json" or f.name.endswith(".safetensors") or f.name == "model.safetensors.index.json":
            continue
        f.unlink()


def llama3_bands(config):
    """Which llama3 band each RoPE frequency falls in (for the report)."""
    rp = config.rope_parameters
    dim = config.head_dim
    inv = [1.0 / rp["rope_theta"] ** (2 * i / dim) for i in range(dim // 2)]
    old = rp["original_max_position_embeddings"]
    lo, hi = old / rp["low_freq_factor"], old / rp["high_freq_factor"]
    bands = []
    for f in inv:
        w = 2 * math.pi / f
        bands.append(("keep" if w < hi else "divide" if w > lo else "smooth", round(w, 2)))
    return bands


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent.parent / "fixtures"))
    args = ap.parse_args()
    out = Path(args.out_dir)
    tiny = out / "tiny"
    tiny.mkdir(parents=True, exist_ok=True)

    records = []
    for name, seed, config, save_dtype, shard in model_specs():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
        randomise(model)
        model.eval()
        if name == "llama3":
            print("llama3 rope bands (band, wavelength):", llama3_bands(model.config))

        d = tiny / name
        if d.exists():
            shutil.rmtree(d)
        save_model = model.to(save_dtype) if save_dtype != torch.float32 else model
        kwargs = {"max_shard_size": shard} if shard else {}
        save_model.save_pretrained(d, **kwargs)
        keep_only(d)

        if save_dtype != torch.float32:
            # The reference is the saved bf16 checkpoint, upcast to float32.
            model = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager", dtype=save_dtype)
            assert next(model.parameters()).dtype == save_dtype
            model = model.float().eval()

        # The prompt: the first of prompt seeds seed*100, seed*100+1, ... whose greedy margins are
        # all >= MIN_MARGIN (so that a small numerical difference cannot flip a greedy step).
        for prompt_seed in range(seed * 100, seed * 100 + MAX_PROMPT_TRIES):
            gen = torch.Generator().manual_seed(prompt_seed)
            prompt = torch.randint(3, VOCAB, (PROMPT_LEN,), generator=gen).tolist()
            full, greedy, margins = reference(model, prompt)
            if min(margins) >= MIN_MARGIN:
                break
        else:
            raise SystemExit(f"{name}: no prompt with all greedy margins >= {MIN_MARGIN}")

        # Save/load round trip: the directory alone must reproduce the logits.
        reloaded = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager").float().eval()
        full2, greedy2, _ = reference(reloaded, prompt)
        diff = float((full - full2).abs().max())
        assert greedy2 == greedy, (name, greedy, greedy2)
        assert diff <= 1e-5, (name, diff)

        print(
            f"{name}: seed {seed}, prompt seed {prompt_seed}, logits std {float(full.std()):.3f}, "
            f"min margin {min(margins):.4f}, margins <0.05: {sum(m < 0.05 for m in margins)}/{len(margins)}, "
            f"reload max|diff| {diff:.2e}"
        )
        records.append(
            {
                "name": name,
                "dir": f"tiny/{name}",
                "dtype": str(save_dtype).replace("torch.", ""),
                "prompt_seed": prompt_seed,
                "prompt_ids": prompt,
                "greedy_ids": greedy,
                "margins": [round(m, 6) for m in margins],
                "last_logits": [round(float(x), 6) for x in full[PROMPT_LEN - 1]],
                "mid_logits": [round(float(x), 6) for x in full[MID_POS]],
            }
        )

    doc = {
        "transformers": transformers.__version__,
        "torch": torch.__version__.split("+")[0],
        "models": records,
    }
    (out / "tiny-models.json").write_text(json.dumps(doc, indent=1) + "\n")
    print("wrote", out / "tiny-models.json")


if __name__ == "__main__":
    main()
