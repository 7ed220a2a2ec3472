#!/usr/bin/env python3
"""GGUF files of the tiny DeepSeek-V3 model, written by llama.cpp's own converter.

kiln loads DeepSeek-V3 / Kimi-K2 GGUF files (llama.cpp's `deepseek2` architecture: `attn_kv_a_mqa`,
`attn_k_b` / `attn_v_b` split from `kv_b_proj`, experts stacked into `ffn_*_exps`, `exp_probs_b`,
the MLA and MoE metadata). To test that against the reference, this script converts the tiny
random `tests/fixtures/tiny/deepseek-v3` checkpoint (written by make_tiny_deepseek.py, whose
transformers logits and greedy tokens are in tiny-deepseek.json) with llama.cpp's
`convert_hf_to_gguf.py` itself, so the GGUF tests compare kiln on llama.cpp's layout against
transformers on the original weights.

The converter needs a tokenizer with at most `vocab_size` (512) tokens; the tiny model has none.
This script writes one: SmolLM2's byte-level BPE (read from the default model's GGUF) cut to its
first 512 ids, keeping the merges whose parts and result survive. The converter identifies a
BPE pre-tokenizer by hashing its output on a test string, which a cut vocabulary cannot match, so
its `get_vocab_base_pre` is told the answer ("smollm", the pre-tokenizer SmolLM2's GGUF names).
Nothing else of the converter is touched. The copy's config.json gains `scoring_func: sigmoid`
and `topk_method: noaux_tc`, as the real DeepSeek-V3 / Kimi-K2 configs carry them (transformers'
DeepseekV3Config has no such fields and always routes that way); without them the converter
writes no `expert_gating_func`, which llama.cpp reads as softmax routing.

Writes engine/tests/fixtures/tiny/deepseek-v3-f32.gguf and deepseek-v3-q8_0.gguf, and
engine/tests/fixtures/tiny-deepseek-gguf.json: per file, what transformers computes on the weights
as stored in it (dequantized by gguf-py, mapped back to the checkpoint's names by inverting the
converter: experts unstacked, `kv_b_proj` rebuilt from `k_b` and `v_b`), on the prompt of
tiny-deepseek.json: logits at position 10 and at the last position, 16 greedy tokens (full
forward each step) and their top-1/top-2 margins. For the f32 file this reference must equal the
original model's (asserted: it checks the inverse mapping); for q8_0 it is the quantized model's
own reference, since Q8_0 changes the numbers.

Run (llama.cpp from the PyPI sdist llama-cpp-python==0.3.36, vendor/llama.cpp; torch,
transformers, tokenizers, numpy, sentencepiece in the Python that runs this):
  python engine/tests/reference/make_tiny_deepseek_gguf.py --llama-cpp DIR --smollm2 FILE.gguf
"""

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
VOCAB = 512
GREEDY_STEPS = 16
MID_POS = 10
OUTTYPES = ["f32", "q8_0"]


def cut_tokenizer(gguf_mod, smollm2: Path, out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers import AddedToken

    reader = gguf_mod.GGUFReader(str(smollm2))

    def strings(key):
        f = reader.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    def ints(key):
        f = reader.fields[key]
        return [int(f.parts[i][0]) for i in f.data]

    tokens = strings("tokenizer.ggml.tokens")[:VOCAB]
    types = ints("tokenizer.ggml.token_type")[:VOCAB]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for m in strings("tokenizer.ggml.merges"):
        a, b = m.split(" ", 1)
        if a in vocab and b in vocab and a + b in vocab:
            merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    control = 3  # llama.cpp's token type for control tokens
    tok.add_special_tokens(
        [AddedToken(t, special=True) for t, ty in zip(tokens, types) if ty == control]
    )
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": tokens[1],
                "eos_token": tokens[2],
                "unk_token": tokens[0],
                "add_bos_token": False,
            }
        )
    )
    print(f"tokenizer: {len(vocab)} tokens, {len(merges)} merges")


def hf_state_from_gguf(gguf_mod, path: Path, config: dict) -> dict:
    """The checkpoint's state dict from a deepseek2 GGUF, every tensor dequantized to float32."""
    import numpy as np
    import torch

    heads = config["num_attention_heads"]
    reader = gguf_mod.GGUFReader(str(path))
    tensors = {}
    for t in reader.tensors:
        values = gguf_mod.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape))
        tensors[t.name] = torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))
    glob = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    per_layer = {
        "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "attn_q_a.weight": "self_attn.q_a_proj.weight",
        "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
        "attn_q_b.weight": "self_attn.q_b_proj.weight",
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
        "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
        "ffn_gate_inp.weight": "mlp.gate.weight",
        "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
        "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
        "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
        "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    }
    state = {}
    for name, t in tensors.items():
        if name in glob:
            state[glob[name]] = t
            continue
        _, layer, rest = name.split(".", 2)
        pre = f"model.layers.{layer}."
        if rest in per_layer:
            state[pre + per_layer[rest]] = t
        elif rest.endswith("_exps.weight"):
            proj = rest.split("_")[1]  # gate / up / down
            for x in range(t.shape[0]):
                state[pre + f"mlp.experts.{x}.{proj}_proj.weight"] = t[x]
        elif rest == "attn_k_b.weight":
            v_b = tensors[f"blk.{layer}.attn_v_b.weight"]  # [heads, v, rank]
            k_b = t.transpose(1, 2)  # [heads, nope, rank]
            kv_b = torch.cat([k_b, v_b], dim=1).reshape(heads * (k_b.shape[1] + v_b.shape[1]), -1)
            state[pre + "self_attn.kv_b_proj.weight"] = kv_b
        elif rest == "attn_v_b.weight":
            continue
        else:
            raise SystemExit(f"{path}: unmapped tensor {name}")
    return state


def reference(model, prompt):
    import torch

    @torch.no_grad()
    def logits_of(ids):
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()

    full = logits_of(prompt)
    ids, greedy, margins = list(prompt), [], []
    for _ in range(GREEDY_STEPS):
        top = torch.topk(logits_of(ids)[-1], 2)
        greedy.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        ids.append(greedy[-1])
    return full, greedy, margins


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree")
    ap.add_argument("--smollm2", type=Path, required=True, help="SmolLM2 Q4_1 GGUF (tokenizer)")
    args = ap.parse_args()
    sys.path.insert(0, str(args.llama_cpp / "gguf-py"))
    sys.path.insert(0, str(args.llama_cpp))
    import gguf  # noqa: E402

    import convert_hf_to_gguf  # noqa: E402
    from conversion import base  # noqa: E402

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "smollm"

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "deepseek-v3"
        shutil.copytree(FIXTURES / "tiny" / "deepseek-v3", src)
        cut_tokenizer(gguf, args.smollm2, src)
        config = json.loads((src / "config.json").read_text())
        config.update(scoring_func="sigmoid", topk_method="noaux_tc")
        (src / "config.json").write_text(json.dumps(config, indent=2))
        for outtype in OUTTYPES:
            out = FIXTURES / "tiny" / f"deepseek-v3-{outtype}.gguf"
            sys.argv = [
                "convert_hf_to_gguf.py",
                str(src),
                "--outfile",
                str(out),
                "--outtype",
                outtype,
            ]
            convert_hf_to_gguf.main()
            print(f"wrote {out} ({out.stat().st_size} bytes)")
        records = [gguf_reference(gguf, src, FIXTURES / "tiny" / f"deepseek-v3-{o}.gguf", o) for o in OUTTYPES]
    import torch
    import transformers

    doc = {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0], "files": records}
    out = FIXTURES / "tiny-deepseek-gguf.json"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")


def gguf_reference(gguf_mod, src: Path, path: Path, outtype: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    config = json.loads((src / "config.json").read_text())
    original = next(m for m in json.loads((FIXTURES / "tiny-deepseek.json").read_text())["models"] if m["name"] == "deepseek-v3")
    from safetensors.torch import save_file

    # Saved in the checkpoint layout and loaded through from_pretrained, which fuses the experts.
    plain = src.parent / f"{path.stem}-dequantized"
    plain.mkdir()
    state = hf_state_from_gguf(gguf_mod, path, config)
    save_file({k: v.contiguous() for k, v in state.items()}, plain / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(src / "config.json", plain / "config.json")
    model = AutoModelForCausalLM.from_pretrained(plain, attn_implementation="eager", dtype=torch.float32).eval()
    prompt = original["prompt_ids"]
    full, greedy, margins = reference(model, prompt)
    if outtype == "f32":
        assert greedy == original["greedy_ids"], (greedy, original["greedy_ids"])
        err = (full[-1] - torch.tensor(original["last_logits"])).abs().max().item()
        assert err < 1e-5, f"f32 GGUF reference differs from the original model by {err}"
    print(f"{path.name}: min margin {min(margins):.4f}, greedy {greedy}")
    return {
        "file": f"tiny/{path.name}",
        "outtype": outtype,
        "prompt_ids": prompt,
        "greedy_ids": greedy,
        "margins": [round(m, 6) for m in margins],
        "mid_logits": [round(float(x), 6) for x in full[MID_POS]],
        "last_logits": [round(float(x), 6) for x in full[len(prompt) - 1]],
    }


if __name__ == "__main__":
    main()
