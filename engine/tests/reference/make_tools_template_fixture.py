"""Writes tests/fixtures/qwen2.5-coder-0.5b.tools_template.json: transformers' rendering of the
Qwen2.5-Coder GGUF's own chat template with `tools`, assistant `tool_calls` and `tool` turns (the
reference kiln's template rendering must equal). Needs transformers, tokenizers and gguf (no torch:
rendering does not touch the vocabulary, so a one-word tokenizer carries the template).

    python3 make_tools_template_fixture.py ~/.cache/kiln/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
"""

import json
import sys
from pathlib import Path

import transformers
from gguf import GGUFReader
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

reader = GGUFReader(sys.argv[1])
field = reader.fields["tokenizer.chat_template"]
template = bytes(field.parts[field.data[0]]).decode()
tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0}, unk_token="a")))
tok.chat_template = template

weather = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name, e.g. Zürich"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
clock = {"type": "function", "function": {
    "name": "get_time", "description": "Time <now> & \"then\"",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}
call = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}
cases = [
    ([{"role": "user", "content": "Weather in Paris?"}], [weather]),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Time?"}], [weather, clock]),
    ([{"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": "", "tool_calls": [call]},
      {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 21}"}], [weather]),
    ([{"role": "user", "content": "Both?"},
      {"role": "assistant", "content": "Checking.", "tool_calls": [call, {
          "id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "CET"}}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
      {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
      {"role": "assistant", "content": "Sunny at noon."},
      {"role": "user", "content": "Thanks"}], [weather, clock]),
]
out = {"transformers": transformers.__version__, "cases": [
    {"messages": m, "tools": t,
     "rendered": tok.apply_chat_template(m, tools=t, tokenize=False, add_generation_prompt=True)}
    for m, t in cases]}
dst = Path(__file__).resolve().parents[1] / "fixtures" / "qwen2.5-coder-0.5b.tools_template.json"
dst.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
print("wrote", dst)
