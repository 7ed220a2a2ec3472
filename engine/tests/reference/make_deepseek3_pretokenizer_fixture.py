#!/usr/bin/env python3
"""What llama.cpp's tokenizer makes of texts under the `deepseek-v3` pre-tokenizer.

DeepSeek-V3 / Kimi-class GGUF files name `tokenizer.ggml.pre = deepseek-v3` (three regex splits: digit
runs of up to three, CJK runs, then letters / punctuation / whitespace). No such vocabulary ships in
a package reachable here, so the check runs that pre-tokenizer over another real byte-level BPE
vocabulary: Qwen2.5-Coder's (151k tokens, the second test model). This script writes a vocab-only
GGUF holding Qwen2.5-Coder's tokenizer metadata with the pre-tokenizer renamed to `deepseek-v3`,
runs llama.cpp's `llama-tokenize` on it for each text, and records the ids in
engine/tests/fixtures/deepseek-v3-pretokenizer.json. kiln's test builds its tokenizer from the same
vocabulary with the same pre-tokenizer name and must give the same ids. The texts are chosen where the deepseek-v3
rules differ from Qwen2's own (a space before a CJK run, CJK between Latin, digit groups,
punctuation glued to letters, combining marks, whitespace runs). With a good BPE vocabulary most
splits give the same ids anyway; the script records Qwen2's own ids too and checks that at least
two texts (the CJK ones) differ, so the test can tell the two pre-tokenizers apart.

Run (llama.cpp from the PyPI sdist llama-cpp-python==0.3.36, `llama-tokenize` built;
numpy in the Python that runs this):
  python engine/tests/reference/make_deepseek3_pretokenizer_fixture.py --llama-cpp DIR --qwen FILE.gguf
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "deepseek-v3-pretokenizer.json"

TEXTS = [
    "Hello world",
    "a 中文 b",
    "東京タワーに行きます。 日本語のテキスト",
    "x = 1234567 + 89",
    "e.g. user@mail.com, (x+y)*2=z;",
    "It's what they'll DO, isn't it?",
    "def f(a, b):\n    return a + b\n\n\n",
    "  leading and trailing   ",
    "tabs\tand\r\nnewlines\n\n  end",
    "Ünïcödé ñ café — “quotes” …",
    "价格是100元，折扣20%！",
    "emoji 🚀🚀 and 3.14159",
    "«Bonjour» ¿Qué tal? ¡Hola! —dash “word”",
    "cafe\u0301 nai\u0308ve re\u0301sume\u0301",
    "₹500 €20 £7 ¥3000",
    "中文English混合text，标点。",
]


def write_vocab_only(gguf, qwen: Path, out: Path) -> None:
    reader = gguf.GGUFReader(str(qwen))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    writer = gguf.GGUFWriter(str(out), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        if name == "tokenizer.ggml.pre":
            writer.add_string(name, "deepseek-v3")
        elif vtype == gguf.GGUFValueType.ARRAY:
            sub = field.types[1]
            if sub == gguf.GGUFValueType.STRING:
                vals = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            else:
                vals = [field.parts[i].tolist()[0] for i in field.data]
            writer.add_array(name, vals)
        elif vtype == gguf.GGUFValueType.STRING:
            writer.add_string(name, bytes(field.parts[-1]).decode("utf-8"))
        else:
            writer.add_key_value(name, field.parts[-1].tolist()[0], vtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tokenize(binary: Path, model: Path, text: str) -> list[int]:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    out = subprocess.run(
        [str(binary), "-m", str(model), "-f", f.name, "--ids", "--log-disable"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    line = [ln for ln in out.splitlines() if ln.startswith("[")][-1]
    return json.loads(line)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", type=Path, required=True)
    ap.add_argument("--qwen", type=Path, required=True)
    args = ap.parse_args()
    sys.path.insert(0, str(args.llama_cpp / "gguf-py"))
    import gguf  # noqa: E402

    binary = args.llama_cpp / "build" / "bin" / "llama-tokenize"
    with tempfile.TemporaryDirectory() as tmp:
        vocab = Path(tmp) / "qwen-vocab-deepseek-v3.gguf"
        write_vocab_only(gguf, args.qwen, vocab)
        cases = []
        differ = 0
        for text in TEXTS:
            ids = tokenize(binary, vocab, text)
            own = tokenize(binary, args.qwen, text)
            differ += ids != own
            cases.append({"text": text, "ids": ids, "qwen2_ids": own})
    assert differ >= 2, f"only {differ} texts tell deepseek-v3 from qwen2"
    FIXTURE.write_text(
        json.dumps(
            {"vocabulary": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pre": "deepseek-v3", "cases": cases},
            ensure_ascii=False,
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {FIXTURE}: {len(cases)} texts, {differ} differ from qwen2's pre-tokenizer")


if __name__ == "__main__":
    main()
