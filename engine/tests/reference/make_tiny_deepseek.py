#!/usr/bin/env python3
"""Tiny random DeepSeek-V3-architecture models (MLA + MoE) and what transformers computes with them.

We cannot run a real DeepSeek-V3 / Kimi-K2 checkpoint here (hundreds of GB), so this script builds
small ones with transformers' own `DeepseekV3ForCausalLM`, saves them the way those checkpoints
ship, and records transformers' logits, greedy tokens and MoE routing decisions for kiln's tests.

Models (all: vocab 512, hidden 64, 3 layers of which the first is dense (first_k_dense_replace 1),
4 heads (8 for the "-8h" pair), kv_lora_rank 32, qk_nope 16 + qk_rope 8, v_head_dim 16, 8 routed experts of
moe_intermediate_size 32 in 4 groups, top-2 groups, 2 experts per token, 1 shared expert,
routed_scaling_factor 2.5, norm_topk_prob, YaRN RoPE factor 4 over original 32 positions):

  deepseek-v3       q_lora_rank 24 (q_a_proj / q_a_layernorm / q_b_proj), YaRN mscale 1 and
                    mscale_all_dim 1 (DeepSeek-V3's own values: softmax scale * mscale^2,
                    rotary attention_factor 1), float32.
  deepseek-v3-fp8   q_lora_rank None (a plain q_proj, as DeepSeek-V2-Lite), YaRN mscale 0.707 /
                    mscale_all_dim 1.0 (so the rotary attention_factor != 1). Every linear weight of
                    the decoder layers stored as float8_e4m3fn with a float32 `weight_scale_inv` per
                    16x16 block (DeepSeek-V3's block-quantized layout; config quantization_config
                    {"quant_method": "fp8", "weight_block_size": [16, 16]}); embedding, norms, router
                    and LM head stay float (bfloat16 / float32) as in the real checkpoint.
  kimi-k2-int4      as deepseek-v3 (q_lora_rank 24), the routed experts stored as compressed-tensors
                    "pack-quantized" symmetric INT4 with group size 32 (weight_packed int32,
                    weight_scale bfloat16, weight_shape), packed by compressed-tensors itself (as
                    Kimi-K2-Thinking ships its experts); the rest float32.
  deepseek-v3-8h,   as deepseek-v3 and kimi-k2-int4 with 8 attention heads, so that tensor
  kimi-k2-int4-8h   parallelism over 8 ranks holds one head and one routed expert per rank; written
                    to tiny-deepseek-8h.json (`--set tiny-deepseek-8h.json` rebuilds only them).

For the quantized models the reference is transformers running on the dequantized weights
(value * scale per block or group), since the quantized forms are storage formats: kiln must
dequantize them to exactly these numbers.

Weights: torch.manual_seed per model; matrices ~ N(0, 0.2^2), RMSNorm weights 1 + 0.1 N(0,1), the
router's e_score_correction_bias ~ N(0, 0.1^2). Eager attention, float32, torch.no_grad, 1 thread.

What it writes: engine/tests/fixtures/tiny/<name>/{config.json, model.safetensors} and
engine/tests/fixtures/tiny-deepseek.json (tiny-deepseek-8h.json for the 8-head pair) with per model: name, dir, prompt_seed, prompt_ids (24),
greedy_ids (16, full forward each step, no cache), margins, last_logits and mid_logits (position
10), and `routing`: for the first MoE layer, the router's input hidden states for every prompt
token and transformers' chosen experts (sorted) with their weights. A prompt is accepted only when
every greedy margin is >= 0.05 and, in every MoE layer for every token of the prompt and the
continuation, the routing choice has a gap >= 1e-3 (group scores and expert scores at the top-k
boundary), so a float rounding difference cannot flip a decision.

Run:  /path/to/venv/bin/python engine/tests/reference/make_tiny_deepseek.py
Needs torch, transformers (>= 5, DeepseekV3) and compressed-tensors; no network.
"""

import argparse
import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM, DeepseekV3Config  # noqa: E402

torch.set_num_threads(1)

VOCAB = 512
PROMPT_LEN = 24
GREEDY_STEPS = 16
MID_POS = 10
MIN_MARGIN = 0.05
MIN_ROUTE_GAP = 1e-3
FP8_BLOCK = 16
INT4_GROUP = 32


def config(q_lora_rank, mscale, mscale_all_dim, heads=4):
    return DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        kv_lora_rank=32,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=128,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": mscale,
            "mscale_all_dim": mscale_all_dim,
        },
        rope_interleave=True,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
    )


# Fixture file -> its models (name, seed, config, quantization). The 8-head pair exists for
# tensor parallelism over 8 ranks (one query head and one routed expert per rank).
SETS = {
    "tiny-deepseek.json": [
        ("deepseek-v3", 201, config(24, 1.0, 1.0), None),
        ("deepseek-v3-fp8", 202, config(None, 0.707, 1.0), "fp8"),
        ("kimi-k2-int4", 203, config(24, 1.0, 1.0), "int4"),
    ],
    "tiny-deepseek-8h.json": [
        ("deepseek-v3-8h", 204, config(24, 1.0, 1.0, heads=8), None),
        ("kimi-k2-int4-8h", 205, config(24, 1.0, 1.0, heads=8), "int4"),
    ],
}


def randomise(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.copy_(0.1 * torch.randn_like(gate.e_score_correction_bias))


class RouteRecorder:
    """Hooks every MoE router: records inputs, decisions, and the smallest decision gap."""

    def __init__(self, model):
        self.calls = []
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                self.handles.append(gate.register_forward_hook(self.hook(i)))

    def hook(self, layer):
        def fn(gate, inputs, outputs):
            hidden = inputs[0].reshape(-1, gate.hidden_dim).float()
            _, weights, indices = outputs
            self.calls.append((layer, hidden, weights, indices, self.gap(gate, hidden)))

        return fn

    @staticmethod
    def gap(gate, hidden):
        scores = torch.sigmoid(hidden @ gate.weight.float().T) + gate.e_score_correction_bias
        per = gate.num_experts // gate.num_group
        group = scores.view(-1, gate.num_group, per).topk(2, dim=-1)[0].sum(-1)
        g = group.sort(dim=-1, descending=True)[0]
        gap = (g[:, gate.topk_group - 1] - g[:, gate.topk_group]).min()
        keep = group.topk(gate.topk_group, dim=-1)[1]
        mask = torch.zeros_like(group).scatter_(1, keep, 1).bool()
        mask = mask.unsqueeze(-1).expand(-1, gate.num_group, per).reshape(-1, gate.num_experts)
        s = scores.masked_fill(~mask, float("-inf")).sort(dim=-1, descending=True)[0]
        return float(min(gap, (s[:, gate.top_k - 1] - s[:, gate.top_k]).min()))

    def clear(self):
        self.calls = []


@torch.no_grad()
def logits_of(model, ids):
    return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()


@torch.no_grad()
def reference(model, recorder, prompt):
    recorder.clear()
    full = logits_of(model, prompt)
    prompt_routes = list(recorder.calls)
    min_gap = min(c[4] for c in recorder.calls)
    ids = list(prompt)
    greedy, margins = [], []
    for _ in range(GREEDY_STEPS):
        recorder.clear()
        last = logits_of(model, ids)[-1]
        min_gap = min(min_gap, min(c[4] for c in recorder.calls))
        top = torch.topk(last, 2)
        greedy.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        ids.append(greedy[-1])
    return full, greedy, margins, prompt_routes, min_gap


def fp8_quantize(state, block):
    """DeepSeek-V3's layout: float8_e4m3fn weights, float32 weight_scale_inv per block."""
    out = {}
    for name, t in state.items():
        linear = name.startswith("model.layers.") and name.endswith("proj.weight") and t.dim() == 2
        if not linear:
            out[name] = t
            continue
        rows, cols = t.shape
        br, bc = -(-rows // block), -(-cols // block)
        scale = torch.empty(br, bc)
        q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
        for i in range(br):
            for j in range(bc):
                blk = t[i * block : (i + 1) * block, j * block : (j + 1) * block]
                s = blk.abs().max().clamp(min=1e-12) / 448.0
                scale[i, j] = s
                q[i * block : (i + 1) * block, j * block : (j + 1) * block] = (blk / s).to(torch.float8_e4m3fn)
        out[name] = q
        out[name + "_scale_inv"] = scale
    return out


def fp8_dequantize(state, block):
    out = {}
    for name, t in state.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            s = state[name + "_scale_inv"]
            s = s.repeat_interleave(block, 0).repeat_interleave(block, 1)[: t.shape[0], : t.shape[1]]
            out[name] = t.float() * s
        else:
            out[name] = t
    return out


def int4_quantize(state, group):
    """compressed-tensors pack-quantized INT4 (symmetric, per-group scales) for routed experts."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    out = {}
    for name, t in state.items():
        if ".mlp.experts." not in name or not name.endswith(".weight"):
            out[name] = t
            continue
        rows, cols = t.shape
        g = t.view(rows, cols // group, group)
        scale = (g.abs().amax(-1) / 7.0).clamp(min=1e-8).to(torch.bfloat16)
        q = torch.round(g / scale.float().unsqueeze(-1)).clamp(-8, 7).to(torch.int8).view(rows, cols)
        base = name[: -len(".weight")]
        out[base + ".weight_packed"] = pack_to_int32(q, 4)
        out[base + ".weight_scale"] = scale
        out[base + ".weight_shape"] = torch.tensor([rows, cols], dtype=torch.int32)
    return out


def int4_dequantize(state, group):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    out = {}
    for name, t in state.items():
        if name.endswith(".weight_packed"):
            base = name[: -len(".weight_packed")]
            shape = torch.Size(state[base + ".weight_shape"].tolist())
            q = unpack_from_int32(t, 4, shape).float()
            s = state[base + ".weight_scale"].float().repeat_interleave(group, 1)
            out[base + ".weight"] = q * s
        elif name.endswith(".weight_scale") or name.endswith(".weight_shape"):
            continue
        else:
            out[name] = t
    return out


def quantization_config(kind):
    if kind == "fp8":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": INT4_GROUP,
                },
            }
        },
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"],
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent.parent / "fixtures"))
    ap.add_argument("--set", choices=sorted(SETS), action="append", help="fixture file(s) to rebuild (default: all)")
    args = ap.parse_args()
    out = Path(args.out_dir)
    for fixture in args.set or sorted(SETS):
        build_set(out, fixture, SETS[fixture])


def build_set(out, fixture, specs):
    records = []
    for name, seed, cfg, quant in specs:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
        randomise(model)
        model.eval()
        d = out / "tiny" / name
        if d.exists():
            shutil.rmtree(d)
        model.save_pretrained(d)
        for f in d.iterdir():
            if f.name not in ("config.json", "model.safetensors"):
                f.unlink()
        if quant:
            state = load_file(d / "model.safetensors")
            if quant == "fp8":
                stored = fp8_quantize(state, FP8_BLOCK)
                plain = fp8_dequantize(stored, FP8_BLOCK)
            else:
                stored = int4_quantize(state, INT4_GROUP)
                plain = int4_dequantize(stored, INT4_GROUP)
            save_file(stored, d / "model.safetensors", metadata={"format": "pt"})
            conf = json.loads((d / "config.json").read_text())
            # The reference runs on exactly the dequantized numbers: saved in the checkpoint
            # layout and loaded back through from_pretrained (which fuses the experts itself).
            plain_dir = out / "tiny" / f".{name}-dequantized"
            plain_dir.mkdir(exist_ok=True)
            save_file({k: v.float() for k, v in plain.items()}, plain_dir / "model.safetensors", metadata={"format": "pt"})
            shutil.copy(d / "config.json", plain_dir / "config.json")
            model = AutoModelForCausalLM.from_pretrained(plain_dir, attn_implementation="eager", dtype=torch.float32).eval()
            shutil.rmtree(plain_dir)
            conf["quantization_config"] = quantization_config(quant)
            (d / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
        recorder = RouteRecorder(model)
        for prompt_seed in range(seed * 100, seed * 100 + 300):
            gen = torch.Generator().manual_seed(prompt_seed)
            prompt = torch.randint(3, VOCAB, (PROMPT_LEN,), generator=gen).tolist()
            full, greedy, margins, routes, gap = reference(model, recorder, prompt)
            if min(margins) >= MIN_MARGIN and gap >= MIN_ROUTE_GAP:
                break
        else:
            raise SystemExit(f"{name}: no prompt with margins >= {MIN_MARGIN} and route gaps >= {MIN_ROUTE_GAP}")
        layer, hidden, weights, indices, _ = routes[0]
        order = indices.sort(dim=-1)
        print(
            f"{name}: prompt seed {prompt_seed}, min margin {min(margins):.4f}, min route gap {gap:.4f}, "
            f"logits std {float(full.std()):.3f}"
        )
        records.append(
            {
                "name": name,
                "dir": f"tiny/{name}",
                "quantization": quant,
                "prompt_seed": prompt_seed,
                "prompt_ids": prompt,
                "greedy_ids": greedy,
                "margins": [round(m, 6) for m in margins],
                "last_logits": [round(float(x), 6) for x in full[PROMPT_LEN - 1]],
                "mid_logits": [round(float(x), 6) for x in full[MID_POS]],
                "routing": {
                    "layer": layer,
                    "hidden": [[round(float(x), 7) for x in row] for row in hidden],
                    "experts": order.values.tolist(),
                    "weights": [
                        [round(float(w), 7) for w in row]
                        for row in weights.gather(1, order.indices)
                    ],
                },
            }
        )
    doc = {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0], "models": records}
    (out / fixture).write_text(json.dumps(doc, indent=1) + "\n")
    print("wrote", out / fixture)


if __name__ == "__main__":
    main()
