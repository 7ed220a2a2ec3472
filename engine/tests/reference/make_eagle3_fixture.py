#!/usr/bin/env python3
"""Build a tiny EAGLE-3 draft head with the `speculators` library and record what it computes.

kiln's EAGLE-3 loader and draft forward are tested against this: the reference implementation
(speculators' `Eagle3DraftModel`, the vLLM/speculators layout) on the same weights and inputs.

What it writes (into engine/tests/fixtures/tiny/)
-------------------------------------------------
  eagle3-speculators/config.json, model.safetensors   the draft as speculators saves it
                                                        (`layers.0.*`, speculators config JSON, with
                                                        embed_tokens, d2t, t2d)
  eagle3-sglang/config.json, model.safetensors         the same weights in the SGLang/EAGLE layout
                                                        (`midlayer.*`, flat LlamaForCausalLMEagle3
                                                        config, no embed_tokens: kiln must take the
                                                        target's)
  eagle3.json                                          the reference outputs below

The target is the tiny `llama3` fixture (make_tiny_models.py: hidden 64, 2 layers, vocab 512).
The draft: one decoder layer of the target's shape, draft vocabulary 128 (d2t: a random injective
draft->target mapping), aux layers [0, 1, 2] (with 2 layers, 2 = the last layer's output), every
matrix ~ N(0, 0.2^2), every norm weight 1 + 0.1 N(0, 1), seed 7.
The SGLang copy's config names aux layers [0, 0, 1] (SGLang adds one: hidden_states [1, 1, 2]).

Reference outputs (float32, eager attention, no_grad):
  prompt_ids        24 target-vocab ids (the first 24 of the tiny llama3 fixture's prompt)
  aux_layer_ids     the aux layers (hidden_states[i] of transformers = the residual stream
                    entering target layer i; i = num_layers is the output after the final norm)
  step0_logits      the draft's logits at every position for inputs (g_t, x_{t+1}): g the target's
                    aux hidden states at t (captured from transformers), x the prompt shifted left by
                    one with `next_id` appended — what kiln's draft-extend computes
  next_id           the token appended after the prompt (the target's greedy next token)
  step1_logits      speculators' second training-time-test step: at position t the draft's own
                    output hidden state from step 0 with the token x_{t+2} (teacher forcing),
                    attending to step 0's keys up to t and to itself — kiln's chained draft step;
                    the last two positions (padding in speculators) are dropped
Logits are rounded to 6 decimals.

How to run
----------
    pip install torch transformers==5.24.0 safetensors
    pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0
    pip install loguru pydantic-settings datasets httpx protobuf
    HF_HUB_OFFLINE=1 python engine/tests/reference/make_eagle3_fixture.py
(speculators 0.9.0 declares torch<=2.14.1 / transformers<=5.19; it runs with torch 2.15.0 and
transformers 5.24.0, the versions the fixtures were made with, recorded in eagle3.json.)
"""

import json
import os
import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig

HERE = Path(__file__).resolve().parent
TINY = HERE.parent / "fixtures" / "tiny"
TARGET = TINY / "llama3"
DRAFT_VOCAB = 128
AUX = [0, 1, 2]
SEED = 7


def rounded(t):
    return [round(float(v), 6) for v in t.flatten().tolist()]


def main():
    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    target = AutoModelForCausalLM.from_pretrained(TARGET, attn_implementation="eager").eval()
    tcfg = target.config
    meta = json.loads((TINY.parent / "tiny-models.json").read_text())
    case = next(m for m in meta["models"] if m["name"] == "llama3")
    prompt = torch.tensor([case["prompt_ids"][:24]])

    layer_cfg = LlamaConfig(**{**tcfg.to_dict(), "num_hidden_layers": 1})
    layer_cfg._attn_implementation = "eager"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer_cfg,
        draft_vocab_size=DRAFT_VOCAB,
        norm_before_residual=False,
        eagle_aux_hidden_state_layer_ids=AUX,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
        ),
    )
    draft = Eagle3DraftModel(config).eval()
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
        draft.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        d2t_target = torch.randperm(tcfg.vocab_size)[:DRAFT_VOCAB].sort().values
        draft.d2t.copy_(d2t_target - torch.arange(DRAFT_VOCAB))
        draft.t2d.zero_()
        draft.t2d[d2t_target] = True

    with torch.no_grad():
        out = target(prompt, output_hidden_states=True)
        next_id = int(out.logits[0, -1].argmax())
        aux = torch.cat([out.hidden_states[i] for i in AUX], dim=-1)
        ids = torch.cat([prompt[:, 1:], torch.tensor([[next_id]])], dim=-1)
        captured = []
        hook = draft.lm_head.register_forward_hook(lambda m, i, o: captured.append(o.detach()))
        draft(
            hidden_states=aux,
            input_ids=ids,
            document_ids=torch.zeros_like(ids),
            ttt_steps=2,
        )
        hook.remove()
    step0, step1 = captured[0][0], captured[1][0]

    out_dir = TINY / "eagle3-speculators"
    draft.save_pretrained(out_dir)
    # save_pretrained copies speculators' config class next to the weights (auto_map); the
    # fixture keeps the weights and config.json only.
    (out_dir / "config.py").unlink(missing_ok=True)
    # The SGLang/EAGLE layout: `midlayer.*`, a flat Llama config, no embed_tokens.
    tensors = load_file(str(out_dir / "model.safetensors"))
    sglang = {
        k.replace("layers.0.", "midlayer."): v
        for k, v in tensors.items()
        if k != "embed_tokens.weight"
    }
    sg_dir = TINY / "eagle3-sglang"
    sg_dir.mkdir(parents=True, exist_ok=True)
    save_file(sglang, str(sg_dir / "model.safetensors"))
    flat = {
        **{k: v for k, v in layer_cfg.to_diff_dict().items() if not k.startswith("_")},
        "architectures": ["LlamaForCausalLMEagle3"],
        "num_hidden_layers": 1,
        "draft_vocab_size": DRAFT_VOCAB,
        "tie_word_embeddings": False,
        # SGLang reads these ids as "the output of layer i" and captures entering layer i + 1:
        # [0, 0, 1] -> hidden_states [1, 1, 2] (its convention cannot name the embedding output).
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 0, 1]},
    }
    (sg_dir / "config.json").write_text(json.dumps(flat, indent=2) + "\n")
    aux_sglang = torch.cat([out.hidden_states[i] for i in [1, 1, 2]], dim=-1)
    with torch.no_grad():
        captured = []
        hook = draft.lm_head.register_forward_hook(lambda m, i, o: captured.append(o.detach()))
        draft(
            hidden_states=aux_sglang,
            input_ids=ids,
            document_ids=torch.zeros_like(ids),
            ttt_steps=1,
        )
        hook.remove()
    sglang_step0 = captured[0][0]

    n = prompt.shape[1]
    record = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "target": "tiny/llama3",
        "prompt_ids": prompt[0].tolist(),
        "next_id": next_id,
        "aux_layer_ids": AUX,
        "draft_vocab_size": DRAFT_VOCAB,
        "d2t_target_ids": d2t_target.tolist(),
        "step0_logits": rounded(step0),
        "step1_logits": rounded(step1[: n - 2]),
        "sglang_aux_layer_ids": [1, 1, 2],
        "sglang_step0_logits": rounded(sglang_step0),
    }
    (TINY / "eagle3.json").write_text(json.dumps(record) + "\n")
    print(f"wrote {out_dir}, {sg_dir}, {TINY / 'eagle3.json'}", file=sys.stderr)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
