#!/usr/bin/env bash
# Memory at load of a Kimi-K2-Thinking-shaped checkpoint whose routed experts are compressed-tensors
# INT4 (pack-quantized, groups of 32), the rest bf16, as the real one stores them: kiln serve's peak
# resident memory (VmHWM, read once it is ready) against the checkpoint's bytes, in fast mode (the
# experts kept packed as Q4_0) and in exact mode (dequantized to f32). The weights are random and the
# tokenizer a word list: this measures loading, not output.
#   bash engine/benches/int4_memory.sh [DIR]      (DIR: where the checkpoint is written)
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:-$(mktemp -d)}
cargo build --release --quiet
python3 - "$DIR" <<'PY'
import json, os, struct, sys

out = sys.argv[1]
hidden, heads, q_lora, kv_lora, nope, rope, v = 1024, 16, 384, 256, 64, 32, 64
inter, moe_inter, experts, layers, vocab = 2048, 512, 64, 4, 32000
config = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
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
    "quantization_config": {
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

bf16("model.embed_tokens.weight", vocab, hidden)
bf16("lm_head.weight", vocab, hidden)
f32("model.norm.weight", hidden, value=1.0)
for l in range(layers):
    p = f"model.layers.{l}."
    f32(p + "input_layernorm.weight", hidden, value=1.0)
    f32(p + "post_attention_layernorm.weight", hidden, value=1.0)
    a = p + "self_attn."
    bf16(a + "q_a_proj.weight", q_lora, hidden)
    f32(a + "q_a_layernorm.weight", q_lora, value=1.0)
    bf16(a + "q_b_proj.weight", heads * (nope + rope), q_lora)
    bf16(a + "kv_a_proj_with_mqa.weight", kv_lora + rope, hidden)
    f32(a + "kv_a_layernorm.weight", kv_lora, value=1.0)
    bf16(a + "kv_b_proj.weight", heads * (nope + v), kv_lora)
    bf16(a + "o_proj.weight", hidden, heads * v)
    m = p + "mlp."
    if l == 0:
        bf16(m + "gate_proj.weight", inter, hidden)
        bf16(m + "up_proj.weight", inter, hidden)
        bf16(m + "down_proj.weight", hidden, inter)
        continue
    f32(m + "gate.weight", experts, hidden, value=0.01)
    f32(m + "gate.e_score_correction_bias", experts)
    bf16(m + "shared_experts.gate_proj.weight", moe_inter, hidden)
    bf16(m + "shared_experts.up_proj.weight", moe_inter, hidden)
    bf16(m + "shared_experts.down_proj.weight", hidden, moe_inter)
    for e in range(experts):
        int4(m + f"experts.{e}.gate_proj.weight", moe_inter, hidden)
        int4(m + f"experts.{e}.up_proj.weight", moe_inter, hidden)
        int4(m + f"experts.{e}.down_proj.weight", hidden, moe_inter)

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
int4_bytes = sum(len(d) for n, _, _, d in tensors if "experts." in n and "shared" not in n)
print(f"checkpoint: {offset / 2**20:.0f} MiB ({int4_bytes / 2**20:.0f} MiB of INT4 experts)")
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
  python3 -c "print(f'$mode: peak resident {$hwm / 2**20:.0f} MiB = {$hwm / $stored:.2f}x the checkpoint ({$stored / 2**20:.0f} MiB)')"
done
