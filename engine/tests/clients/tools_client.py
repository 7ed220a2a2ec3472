"""Tool calling through the official `openai` client against a running `kiln serve` on
Qwen2.5-Coder-0.5B-Instruct (its chat template carries hermes-style tools): a forced call, its
result sent back and a final answer; a named call streamed and reassembled by index; a call the
model writes on its own under `tool_choice: "auto"`; `none`; pydantic function tools through
`parse`. Usage: tools_client.py BASE_URL"""

import json
import sys

import openai
import pydantic

base = sys.argv[1]
client = openai.OpenAI(base_url=base + "/v1", api_key="none")
model = client.models.list().data[0].id

weather = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
clock = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
}
ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]

# A forced call, then its result, then the final answer.
r = client.chat.completions.create(
    model=model, messages=ask, tools=[weather, clock], tool_choice="required", max_tokens=64, temperature=0
)
choice = r.choices[0]
assert choice.finish_reason == "tool_calls", choice
call = choice.message.tool_calls[0]
assert call.type == "function" and call.id.startswith("call_"), call
assert call.function.name in ("get_weather", "get_time"), call
args = json.loads(call.function.arguments)
print("forced call", call.function.name, args)
history = ask + [
    {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
    {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})},
]
final = client.chat.completions.create(model=model, messages=history, tools=[weather, clock], max_tokens=48, temperature=0)
answer = final.choices[0]
# The history (the call, then its result) went into the prompt; a 0.5B model may answer in text
# or call again, either is a well-formed reply.
assert final.usage.prompt_tokens > r.usage.prompt_tokens + 10, (final.usage, r.usage)
assert answer.message.content or answer.message.tool_calls, answer
assert answer.finish_reason in ("stop", "length", "tool_calls"), answer
print("final answer", answer.message)

# A named call, streamed: id and name first, then argument fragments, reassembled by index.
calls = {}
finish = None
for chunk in client.chat.completions.create(
    model=model, messages=ask, tools=[weather, clock], max_tokens=64, temperature=0, stream=True,
    tool_choice={"type": "function", "function": {"name": "get_weather"}},
):
    if not chunk.choices:
        continue
    c = chunk.choices[0]
    for d in c.delta.tool_calls or []:
        slot = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
        if d.id:
            assert slot["id"] is None, "the id comes once"
            slot["id"], slot["name"] = d.id, d.function.name
        else:
            assert slot["id"] is not None, "arguments before the call's id"
        slot["arguments"] += d.function.arguments or ""
    finish = c.finish_reason or finish
assert finish == "tool_calls", finish
assert list(calls) == [0] and calls[0]["name"] == "get_weather", calls
streamed_args = json.loads(calls[0]["arguments"])
assert isinstance(streamed_args.get("city"), str), streamed_args
print("streamed call", calls)

# Under auto the model decides; this prompt makes Qwen2.5-Coder call on its own (greedy).
r = client.chat.completions.create(
    model=model, max_tokens=64, temperature=0, tools=[weather, clock], tool_choice="auto",
    messages=[{"role": "user", "content": "Use a tool to look up the current weather in Tokyo."}],
)
choice = r.choices[0]
print("auto", choice.message)
assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
assert choice.message.tool_calls[0].function.name == "get_weather", choice
assert "Tokyo" in json.loads(choice.message.tool_calls[0].function.arguments)["city"], choice

# none: the tools are shown but the reply is text, never parsed.
r = client.chat.completions.create(
    model=model, messages=ask, tools=[weather], tool_choice="none", max_tokens=24, temperature=0
)
assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason != "tool_calls", r


# pydantic function tools (strict schemas) through parse.
class GetTime(pydantic.BaseModel):
    zone: str


r = client.beta.chat.completions.parse(
    model=model, max_tokens=64, temperature=0, tool_choice="required",
    messages=[{"role": "user", "content": "What time is it in Berlin?"}],
    tools=[openai.pydantic_function_tool(GetTime)],
)
parsed = r.choices[0].message.tool_calls[0].function.parsed_arguments
assert isinstance(parsed, GetTime), r
print("parsed tool", parsed)

# An unknown named tool is a 400 naming tool_choice.
try:
    client.chat.completions.create(
        model=model, messages=ask, tools=[weather], max_tokens=4,
        tool_choice={"type": "function", "function": {"name": "nope"}},
    )
    raise AssertionError("an unknown tool was accepted")
except openai.BadRequestError as e:
    assert e.body["param"] == "tool_choice", e.body
print("ALL CHECKS PASSED")
