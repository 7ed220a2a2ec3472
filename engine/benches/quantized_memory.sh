#!/usr/bin/env bash
# Memory at load of the two quantized layouts the reference box's models are stored in, each in a
# checkpoint of their shape with random weights (the tokenizer a word list: this measures loading,
# not output): kiln serve's peak resident memory (VmHWM, read once it is ready) against the
# checkpoint's bytes, in fast mode (weights kept as stored) and in exact mode (dequantized to f32).
#   int4: Kimi-K2-Thinking's layout: routed experts compressed-tensors INT4 (pack-quantized, groups
#         of 32, kept as Q4_0 in fast mode), the rest bf16.
#   fp8:  DeepSeek-V3's: every linear layer block FP8 (e4m3, 128 x 128 scales, kept as F8Blocks in
#         fast mode), embeddings, norms and router bf16 / f32.
#   bash engine/benches/quantized_memory.sh [int4|fp8|both] [DIR]   (DIR: where checkpoints go)
set -euo pipefail
cd "$(dirname "$0")/../.."
KINDS=${1:-both}
[ "$KINDS" = both ] && KINDS="int4 fp8"
ROOT=${2:-$(mktemp -d)}
cargo build --release --quiet
for KIND in $KINDS; do
DIR="$ROOT/$KIND"
python3 - "$DIR" "$KIND" <<'PY'
import json, os, struct, sys

out, kind = sys.argv[1], sys.argv[2]
hidden, heads, q_lora, kv_lora, nope, rope, v = 1024, 16, 384, 256, 64, 32, 64
inter, moe_inter, experts, layers, vocab = 2048, 512, 64, 4, 32000
if kind == "fp8":
    # DeepSeek-V3's head dimensions (nope 128, rope 64, v 128) so its 128-row scale blocks meet
    # whole heads; 40 experts bring the checkpoint to about 327 MiB.
    heads, nope, rope, v, q_lora, kv_lora, experts = 8, 128, 64, 128, 384, 512, 40
config = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3" if kind == "fp8" else "kimi_k2",
    "hidden_size": hidden, "intermediate_size": inter, "moe_intermediate_size": moe_inter,
    "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
    "q_lora_rank": q_lora, "kv_lora_rank": kv_lora, "qk_nope_head_dim": nope,
    "qk_rope_head_dim": rope, "v_head_dim": v, "qk_head_dim": nope + rope, "head_dim": rope,
    "n_routed_experts": experts, "n_shared_experts": 1, "num_experts_per_tok": 4,
    "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
    "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    "rms_norm_eps": 1e-6, "rope_theta": 50000.0, "max_position_embeddings": 4096,
    "vocab_size": vocab, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
    "hidden_act": "silu", "attention_bias": False, "rope_interleave": True,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                             "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    if kind == "fp8" else {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
            "group_size": 32}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                   "re:.*mlp\\.(gate|up|down)_proj.*"],
    },
}
tensors = []  # (name, dtype, shape, bytes)
BF16_SMALL = struct.pack("<H", 0x3C24)  # 0.01

def bf16(name, *shape):
    n = 1
    for d in shape:
        n *= d
    tensors.append((name, "BF16", list(shape), BF16_SMALL * n))

def f32(name, *shape, value=0.0):
    n = 1
    for d in shape:
        n *= d
    tensors.append((name, "F32", list(shape), struct.pack("<f", value) * n))

def int4(name, rows, cols):
    tensors.append((name + "_packed", "I32", [rows, cols // 8], os.urandom(rows * cols // 2)))
    tensors.append((name + "_scale", "BF16", [rows, cols // 32], BF16_SMALL * (rows * cols // 32)))
    tensors.append((name + "_shape", "I32", [2], struct.pack("<ii", rows, cols)))

def fp8(name, rows, cols):
    # Random e4m3 bytes short of the NaN pattern (bit 3 cleared), one f32 scale per 128 x 128.
    tensors.append((name, "F8_E4M3", [rows, cols], bytes(b & 0xf7 for b in os.urandom(rows * cols))))
    blocks = [-(-rows // 128), -(-cols // 128)]
    tensors.append((name + "_scale_inv", "F32", blocks, struct.pack("<f", 1e-3) * (blocks[0] * blocks[1])))

# The projections: FP8 throughout in DeepSeek-V3's layout; bf16 beside Kimi's INT4 experts.
linear = fp8 if kind == "fp8" else (lambda name, rows, cols: bf16(name, rows, cols))
expert = fp8 if kind == "fp8" else int4

bf16("model.embed_tokens.weight", vocab, hidden)
bf16("lm_head.weight", vocab, hidden)
f32("model.norm.weight", hidden, value=1.0)
for l in range(layers):
    p = f"model.layers.{l}."
    f32(p + "input_layernorm.weight", hidden, value=1.0)
    f32(p + "post_attention_layernorm.weight", hidden, value=1.0)
    a = p + "self_attn."
    linear(a + "q_a_proj.weight", q_lora, hidden)
    f32(a + "q_a_layernorm.weight", q_lora, value=1.0)
    linear(a + "q_b_proj.weight", heads * (nope + rope), q_lora)
    linear(a + "kv_a_proj_with_mqa.weight", kv_lora + rope, hidden)
    f32(a + "kv_a_layernorm.weight", kv_lora, value=1.0)
    linear(a + "kv_b_proj.weight", heads * (nope + v), kv_lora)
    linear(a + "o_proj.weight", hidden, heads * v)
    m = p + "mlp."
    if l == 0:
        linear(m + "gate_proj.weight", inter, hidden)
        linear(m + "up_proj.weight", inter, hidden)
        linear(m + "down_proj.weight", hidden, inter)
        continue
    f32(m + "gate.weight", experts, hidden, value=0.01)
    f32(m + "gate.e_score_correction_bias", experts)
    linear(m + "shared_experts.gate_proj.weight", moe_inter, hidden)
    linear(m + "shared_experts.up_proj.weight", moe_inter, hidden)
    linear(m + "shared_experts.down_proj.weight", hidden, moe_inter)
    for e in range(experts):
        expert(m + f"experts.{e}.gate_proj.weight", moe_inter, hidden)
        expert(m + f"experts.{e}.up_proj.weight", moe_inter, hidden)
        expert(m + f"experts.{e}.down_proj.weight", hidden, moe_inter)

header, offset = {}, 0
for name, dtype, shape, data in tensors:
    header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
    offset += len(data)
h = json.dumps(header).encode()
h += b" " * (-len(h) % 8)
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "model.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", len(h)))
    f.write(h)
    for *_, data in tensors:
        f.write(data)
json.dump(config, open(os.path.join(out, "config.json"), "w"), indent=1)
words = {"<unk>": 0, "<s>": 1, "</s>": 2}
words.update({f"w{i}": i for i in range(3, vocab)})
json.dump({"version": "1.0", "truncation": None, "padding": None, "added_tokens": [
    {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
     "normalized": False, "special": True} for t, i in [("<unk>", 0), ("<s>", 1), ("</s>", 2)]],
    "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
    "decoder": None, "model": {"type": "WordLevel", "vocab": words, "unk_token": "<unk>"}},
    open(os.path.join(out, "tokenizer.json"), "w"))
quantized = sum(len(d) for n, t, _, d in tensors if t in ("F8_E4M3", "I32"))
print(f"{kind} checkpoint: {offset / 2**20:.0f} MiB ({quantized / 2**20:.0f} MiB of {kind} weights)")
PY
stored=$(stat -c %s "$DIR/model.safetensors")
for mode in fast exact; do
  ./target/release/kiln serve --model "$DIR" --mode "$mode" --port 18312 --kv-tokens 512 \
    --threads 2 >/dev/null 2>&1 &
  pid=$!
  for _ in $(seq 1200); do curl -sf http://127.0.0.1:18312/ready >/dev/null && break; sleep 0.2; done
  curl -sf http://127.0.0.1:18312/ready >/dev/null || { echo "$mode: the server did not get ready"; kill $pid; exit 1; }
  hwm=$(awk '/VmHWM/ {print $2 * 1024}' /proc/$pid/status)
  kill $pid; wait $pid 2>/dev/null || true
  python3 -c "print(f'$KIND $mode: peak resident {$hwm / 2**20:.0f} MiB = {$hwm / $stored:.2f}x the checkpoint ({$stored / 2**20:.0f} MiB)')"
done
done
