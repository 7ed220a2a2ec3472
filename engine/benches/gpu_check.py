#!/usr/bin/env python3
"""The end-to-end half of the GPU check (engine/benches/gpu-check.sh runs it on a lent machine).

  python3 engine/benches/gpu_check.py --kiln KILN --out DIR [--device cuda] [--skip-speed]

1. Parity: tiny random Llama 3, Qwen2, Qwen3 and Mistral models, written here by transformers
   (bf16, with a word-level tokenizer "t0 t1 ..."), served by `kiln serve --device cuda`; a 24-token
   prompt, 32 greedy tokens with logprobs through /v1/completions, against transformers' greedy
   generate on the same GPU in bf16 (eager attention, no cache tricks). Pass: the tokens are equal,
   or they part where transformers' top two logits are within TIE (a near-tie bf16 cannot order);
   and every shared token's logprob is within LOGPROB_TOL of transformers'. Then the tiny
   DeepSeek-V3 / Kimi-K2 models of tests/fixtures (MLA + MoE; float32, block FP8, INT4 experts)
   against the transformers float32 greedy tokens recorded there, by the same rule.
2. Speed: a Llama-3-8B-shaped model (hidden 4096, 32 heads of 128, 8 KV heads, MLP 14336, vocab
   128256) with SPEED_LAYERS layers of random bf16 weights. kiln generate --device cuda: batch-1
   decode tok/s after a 512-token prompt and prefill tok/s at 512 and 4096 tokens; kiln serve driven
   by kiln bench at C = 1, 8, 64 (512-token prompts, 128 new tokens, 2C + 4 requests): decode steps
   from CUDA graphs with overlap scheduling (the default), the same with --disable-cuda-graph
   (every step eager), with --disable-overlap-schedule (the host waits for each step's tokens
   before planning the next), and n-gram speculation (which plans after each step's tokens).
   `kiln generate` runs one sequence eagerly (no runner, no graphs). Beside decode, the roofline:
   bytes read per step (weights but the embedding table, plus
   the KV read at that context) over the read bandwidth measured here (a torch sum over 4 GiB:
   bytes read only). Beside prefill, the bf16 GEMM rate measured here (torch, 8192^3). The peer row:
   transformers generate on the same weights, bf16, SDPA attention, static KV cache, as its docs
   recommend for speed, without torch.compile (its compile warm-up alone exceeds this budget).
Results: a table on stdout, DIR/e2e.json. Exit 1 when a parity case fails.
"""

import argparse
import json
import os
import tempfile
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

TIE = 0.1  # bf16 logits of magnitude up to 16 are 1/16 apart: closer than this is a tie
LOGPROB_TOL = 0.1  # |kiln logprob - transformers logprob| of each shared greedy token
PROMPT_LEN, NEW_TOKENS = 24, 32
VOCAB = 4096
SPEED_LAYERS = int(os.environ.get("SPEED_LAYERS", "8"))


def log(msg):
    print(msg, flush=True)


def tokenizer(d: Path, vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins tokens with spaces
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": "t2"}))


def tiny_configs():
    import transformers as T

    common = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=8, max_position_embeddings=2048, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False, rms_norm_eps=1e-5)
    return {
        "llama3": T.LlamaConfig(**common, num_key_value_heads=2, rope_theta=500000.0),
        "qwen2": T.Qwen2Config(**common, num_key_value_heads=2, rope_theta=1000000.0),
        "qwen3": T.Qwen3Config(**{**common, "num_attention_heads": 4}, num_key_value_heads=2,
                               head_dim=128, rope_theta=1000000.0),
        "mistral": T.MistralConfig(**common, num_key_value_heads=4, rope_theta=10000.0,
                                   sliding_window=None),
    }


def build(cfg, d: Path, vocab: int, seed: int):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Peaked logits: greedy paths with clear winners, as a trained model has.
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.06 * torch.randn_like(p))
    model.save_pretrained(d)
    tokenizer(d, vocab)
    return model


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Server:
    """kiln serve on a model directory, until closed."""

    def __init__(self, kiln, model, device, extra=(), log_path=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [kiln, "serve", "--model", str(model), "--device", device, "--port", str(self.port),
               *extra]
        log("  $ " + " ".join(cmd))
        self.log = open(log_path or os.devnull, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 180
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kiln serve exited with {self.proc.returncode} (see {log_path})")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except Exception:
                time.sleep(0.5)
        self.close()
        raise RuntimeError("kiln serve did not become ready in 180 s")

    def post(self, path, body):
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())

    def get(self, path):
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.loads(r.read())

    def close(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def served_greedy(a, d, prompt, n, log_name):
    """kiln serve --device a.device on model dir d: n greedy tokens after prompt through
    /v1/completions, as (token ids, their logprobs)."""
    server = Server(a.kiln, d, a.device, log_path=a.out / f"serve-{log_name}.log")
    try:
        r = server.post("/v1/completions", {"model": server.get("/v1/models")["data"][0]["id"],
                                             "prompt": prompt, "max_tokens": n,
                                             "temperature": 0, "logprobs": 1, "ignore_eos": True})
    finally:
        server.close()
    lp = r["choices"][0]["logprobs"]
    return token_ids(lp["tokens"]), lp["token_logprobs"]


def token_ids(pieces):
    out = []
    for p in pieces:
        m = re.search(r"t(\d+)", p)
        out.append(int(m.group(1)) if m else -1)
    return out


def parity_case(name, cfg, a, root):
    import torch

    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    model = build(cfg, d, VOCAB, seed=len(name))
    dev = "cuda" if a.device == "cuda" else "cpu"
    model = model.to(dev).eval()
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, VOCAB, (PROMPT_LEN,), generator=g).tolist()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=dev), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    want = out.sequences[0, PROMPT_LEN:].tolist()
    logits = [l[0].float() for l in out.logits]
    got, kiln_lp = served_greedy(a, d, prompt, NEW_TOKENS, name)
    parted, verdict, worst = None, "equal", 0.0
    for i, (w, k) in enumerate(zip(want, got)):
        ref_lp = torch.log_softmax(logits[i], -1)
        worst = max(worst, abs(float(ref_lp[k]) - kiln_lp[i]) if k >= 0 else float("inf"))
        if w != k:
            top2 = torch.topk(logits[i], 2).values
            gap = float(logits[i][w] - logits[i][k]) if k >= 0 else float("inf")
            parted = i
            verdict = f"near-tie at {i} (gap {gap:.3f})" if gap <= TIE else f"DIFFERS at {i} (gap {gap:.3f}, top2 {top2.tolist()})"
            break
    if len(got) != len(want) and parted is None:
        verdict = f"DIFFERS: {len(got)} tokens, want {len(want)}"
    ok = not verdict.startswith("DIFFERS") and worst <= LOGPROB_TOL
    return {"model": name, "tokens_equal": parted is None and len(got) == len(want),
            "verdict": verdict, "max_logprob_error": worst, "pass": ok,
            "want": want, "got": got}


FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"


def deepseek_cases():
    """The tiny DeepSeek-V3 / Kimi-K2 models the CPU tests use (MLA + MoE: float32, block FP8,
    compressed-tensors INT4 experts; 4 and 8 heads), with transformers' float32 greedy tokens and
    per-step top-2 margins from tests/reference/make_tiny_deepseek.py."""
    for fixture in ("tiny-deepseek.json", "tiny-deepseek-8h.json"):
        for m in json.loads((FIXTURES / fixture).read_text())["models"]:
            yield m


def deepseek_parity_case(m, a, root):
    """kiln serve --device cuda (bf16) on a copy of the fixture with a word-level tokenizer; the
    greedy tokens against transformers' float32 ones: equal, or parted where the reference's
    top-2 margin is within TIE; the first token's logprob against the reference's."""
    import math
    import shutil

    name = m["name"]
    d = root / f"deepseek-{name}"
    if d.exists():
        shutil.rmtree(d)
    shutil.copytree(FIXTURES / m["dir"], d)
    tokenizer(d, 512)
    prompt, want, margins = m["prompt_ids"], m["greedy_ids"], m["margins"]
    got, kiln_lp = served_greedy(a, d, prompt, len(want), f"deepseek-{name}")
    last = m["last_logits"]
    top = max(last)
    log_z = top + math.log(sum(math.exp(x - top) for x in last))
    first_error = abs((last[got[0]] - log_z) - kiln_lp[0]) if got and got[0] >= 0 else float("inf")
    verdict = "equal"
    for i, (w, k) in enumerate(zip(want, got)):
        if w != k:
            verdict = (f"near-tie at {i} (reference margin {margins[i]:.3f})" if margins[i] <= TIE
                       else f"DIFFERS at {i} (reference margin {margins[i]:.3f})")
            break
    else:
        if len(got) != len(want):
            verdict = f"DIFFERS: {len(got)} tokens, want {len(want)}"
    ok = not verdict.startswith("DIFFERS") and first_error <= LOGPROB_TOL
    return {"model": name, "tokens_equal": verdict == "equal", "verdict": verdict,
            "max_logprob_error": first_error, "pass": ok, "want": want, "got": got}


def measured_bandwidth_and_gemm():
    import torch

    x = torch.empty(2 * 1024**3, dtype=torch.bfloat16, device="cuda").normal_()
    torch.cuda.synchronize()
    for _ in range(2):
        x.sum()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        x.sum()
    torch.cuda.synchronize()
    read_bw = 5 * x.numel() * 2 / (time.perf_counter() - t)
    del x
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    gemm = 10 * 2 * 8192**3 / (time.perf_counter() - t)
    return read_bw, gemm


def kiln_generate(a, d, prompt, new):
    cmd = [a.kiln, "generate", "--device", a.device, "--model", str(d), "--prompt-ids",
           ",".join(map(str, prompt)), "--max-tokens", str(new), "--ignore-eos"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"kiln generate failed: {r.stderr[-2000:]}")
    m = re.search(r"prefill: (\d+) tokens in ([\d.]+)s \(([\d.]+) tok/s\) \| decode: (\d+) tokens in ([\d.]+)s \(([\d.]+) tok/s\)", r.stderr)
    if not m:
        raise RuntimeError(f"no timing line in: {r.stderr[-1000:]}")
    return float(m.group(3)), float(m.group(6))


def speed(a, root, results):
    import torch
    import transformers as T

    d = root / "llama3-8b-shape"
    d.mkdir(parents=True, exist_ok=True)
    cfg = T.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                        num_hidden_layers=SPEED_LAYERS, num_attention_heads=32,
                        num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
                        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    t = time.perf_counter()
    model = build(cfg, d, 128256, seed=1)
    log(f"  wrote {SPEED_LAYERS}-layer Llama-3-8B-shaped model in {time.perf_counter() - t:.0f} s")
    read_bw, gemm = measured_bandwidth_and_gemm()
    log(f"  measured: read bandwidth {read_bw / 1e9:.0f} GB/s, bf16 GEMM {gemm / 1e12:.0f} TFLOP/s")
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    kv_per_token = SPEED_LAYERS * 2 * 8 * 128 * 2
    step_bytes = params * 2 + 512 * kv_per_token
    roofline = read_bw / step_bytes
    prompt = [3 + (i * 7919) % 128000 for i in range(4096)]
    row = {"layers": SPEED_LAYERS, "read_bw_GBps": read_bw / 1e9, "gemm_TFLOPs": gemm / 1e12,
           "bytes_per_decode_step": step_bytes, "roofline_decode_tok_s": roofline}
    try:
        p512, d512 = kiln_generate(a, d, prompt[:512], 129)
        p4096, _ = kiln_generate(a, d, prompt, 2)
        flops_per_token = 2 * params
        row.update({"kiln_decode_tok_s_b1": d512, "kiln_prefill_tok_s_512": p512,
                    "kiln_prefill_tok_s_4096": p4096,
                    "kiln_decode_vs_roofline": d512 / roofline,
                    "kiln_prefill_4096_vs_gemm": p4096 * flops_per_token / gemm})
    except Exception as e:
        row["kiln_error"] = str(e)
    model = model.to("cuda").eval()
    model.generation_config.cache_implementation = "static"
    ids = torch.tensor([prompt[:512]], device="cuda")
    with torch.no_grad():
        model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        torch.cuda.synchronize()
        times = {}
        for n in (1, 129):
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            torch.cuda.synchronize()
            times[n] = time.perf_counter() - t
    row["transformers_decode_tok_s_b1"] = 128 / (times[129] - times[1])
    if "kiln_decode_tok_s_b1" in row:
        row["kiln_vs_transformers_b1"] = row["kiln_decode_tok_s_b1"] / row["transformers_decode_tok_s_b1"]
    del model
    torch.cuda.empty_cache()
    results["speed"] = row

    prompts = a.out / "prompts.jsonl"
    with open(prompts, "w") as f:
        for k in range(200):
            f.write(json.dumps({"prompt": " ".join(f"t{3 + (k * 131 + i * 17) % 128000}" for i in range(512))}) + "\n")
    serving = []
    for label, extra in (("none", []), ("none-eager", ["--disable-cuda-graph"]),
                         ("none-no-overlap", ["--disable-overlap-schedule"]),
                         ("ngram", ["--speculative-algorithm", "ngram"])):
        try:
            s = Server(a.kiln, d, a.device, extra=extra, log_path=a.out / f"serve-speed-{label}.log")
        except Exception as e:
            serving.append({"speculation": label, "error": str(e)})
            continue
        try:
            stem = a.out / f"bench-{label}"
            cmd = [a.kiln, "bench", "--url", s.url, "--concurrency", "1,8,64", "--max-tokens", "128",
                   "--dataset", str(prompts), "--endpoint", "completions", "--out", str(stem), "--label", f"kiln cuda {label}"]
            log("  $ " + " ".join(cmd))
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
            print(r.stdout[-3000:], flush=True)
            serving.append({"speculation": label, "rc": r.returncode,
                            "bench": json.loads(Path(f"{stem}.json").read_text())
                            if Path(f"{stem}.json").exists() else None})
        finally:
            s.close()
    results["serving"] = serving


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--skip-speed", action="store_true")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    root = Path(os.environ.get("KILN_GPU_MODELS") or Path(tempfile.gettempdir()) / "kiln-gpu-models")
    log(f"parity: tokens equal up to near-ties (top-2 gap <= {TIE}); logprobs within {LOGPROB_TOL}")
    results = {"tie": TIE, "logprob_tol": LOGPROB_TOL, "parity": []}
    for name, cfg in tiny_configs().items():
        log(f"== parity {name}")
        try:
            r = parity_case(name, cfg, a, root)
        except Exception as e:
            r = {"model": name, "pass": False, "verdict": f"error: {e}"}
        results["parity"].append(r)
        log(f"   {name}: {r['verdict']}, max logprob error {r.get('max_logprob_error', float('nan')):.3f}"
            f" -> {'pass' if r['pass'] else 'FAIL'}")
        (a.out / "e2e.json").write_text(json.dumps(results, indent=1))
    # MLA + MoE on the GPU (issue 28): the DeepSeek-V3 / Kimi-K2 tiny models against transformers.
    for m in deepseek_cases():
        log(f"== parity {m['name']} (MLA + MoE)")
        try:
            r = deepseek_parity_case(m, a, root)
        except Exception as e:
            r = {"model": m["name"], "pass": False, "verdict": f"error: {e}"}
        results["parity"].append(r)
        log(f"   {m['name']}: {r['verdict']}, first-token logprob error "
            f"{r.get('max_logprob_error', float('nan')):.3f} -> {'pass' if r['pass'] else 'FAIL'}")
        (a.out / "e2e.json").write_text(json.dumps(results, indent=1))
    if not a.skip_speed:
        log("== speed")
        try:
            speed(a, root, results)
        except Exception as e:
            results["speed_error"] = str(e)
            log(f"   speed: {e}")
        for k, v in results.get("speed", {}).items():
            log(f"   {k:<32} {v:.4g}" if isinstance(v, float) else f"   {k:<32} {v}")
    (a.out / "e2e.json").write_text(json.dumps(results, indent=1))
    failed = [r["model"] for r in results["parity"] if not r["pass"]]
    if failed:
        log(f"parity FAILED: {', '.join(failed)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
