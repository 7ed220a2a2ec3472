"""Drives a running `kiln serve` with the official `openai` package and parses /metrics with
prometheus_client's OpenMetrics parser. Usage: openai_client.py BASE_URL API_KEY"""

import sys
import urllib.request

import openai
from prometheus_client.openmetrics.parser import text_string_to_metric_families

base, key = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base + "/v1", api_key=key)

models = client.models.list()
model = models.data[0].id
print("model", model)

# Completions, greedy, with usage.
c = client.completions.create(model=model, prompt="def add(a, b):", max_tokens=12, temperature=0)
assert c.object == "text_completion" and c.id.startswith("cmpl-"), c
assert c.usage.completion_tokens == 12 and c.choices[0].finish_reason == "length", c
greedy_text = c.choices[0].text

# Streaming completions reassemble to the same text.
parts = []
for chunk in client.completions.create(
    model=model, prompt="def add(a, b):", max_tokens=12, temperature=0, stream=True
):
    parts.append(chunk.choices[0].text)
assert "".join(parts) == greedy_text, (parts, greedy_text)

# Chat, non-streaming and streaming with usage.
r = client.chat.completions.create(
    model=model,
    messages=[{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a colour."}],
    max_tokens=16,
    temperature=0,
)
msg = r.choices[0].message
assert msg.role == "assistant" and msg.content, r
assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

text, usage, finishes = "", None, []
stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Name a colour."}, ],
    max_tokens=16,
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
)
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for ch in chunk.choices:
        text += ch.delta.content or ""
        if ch.finish_reason:
            finishes.append(ch.finish_reason)
assert usage is not None and usage.completion_tokens >= 1, usage
assert len(finishes) == 1, finishes

# Stop strings: the text ends before the stop string, finish_reason is "stop".
full = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0)
assert " 7" in full.choices[0].text, full.choices[0].text
s = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[" 7"])
assert s.choices[0].finish_reason == "stop", s
assert s.choices[0].text == full.choices[0].text.split(" 7")[0], (s.choices[0].text, full.choices[0].text)

# Logprobs: chosen token first among the alternatives under greedy.
lp = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0,
    logprobs=True, top_logprobs=3,
)
content = lp.choices[0].logprobs.content
assert len(content) == lp.usage.completion_tokens
for t in content:
    assert len(t.top_logprobs) == 3 and t.logprob <= 0
    assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-4, t
cl = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
assert len(cl.choices[0].logprobs.token_logprobs) == 4 and len(cl.choices[0].logprobs.top_logprobs[0]) == 2

# n > 1 with a seed: reproducible.
a = client.completions.create(model=model, prompt="Once", max_tokens=8, temperature=1.0, n=3, seed=7)
b = client.completions.create(model=model, prompt="Once", max_tokens=8, temperature=1.0, n=3, seed=7)
assert [c.text for c in a.choices] == [c.text for c in b.choices] and len(a.choices) == 3

# Errors surface as the client's typed exceptions.
try:
    client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    raise SystemExit("unknown model accepted")
except openai.NotFoundError:
    pass
try:
    openai.OpenAI(base_url=base + "/v1", api_key="wrong").models.list()
    raise SystemExit("wrong key accepted")
except openai.AuthenticationError:
    pass

# /metrics parses with a real Prometheus (OpenMetrics) parser and counts what we did.
body = urllib.request.urlopen(base + "/metrics").read().decode()
families = {f.name: f for f in text_string_to_metric_families(body)}
for name in ["kiln_requests", "kiln_generation_tokens", "kiln_kv_blocks_used", "kiln_time_to_first_token_seconds",
             "kiln_inter_token_latency_seconds", "kiln_e2e_request_latency_seconds", "kiln_step_duration_seconds",
             "kiln_batch_size", "kiln_preemptions", "kiln_running_requests", "kiln_waiting_requests"]:
    assert name in families, (name, sorted(families))
gen = sum(s.value for s in families["kiln_generation_tokens"].samples if s.name.endswith("_total"))
assert gen >= 12 + 12 + 16, gen
labels = families["kiln_generation_tokens"].samples[0].labels
assert labels["model"] == model and "instance" in labels, labels
ok = [s for s in families["kiln_requests"].samples if s.labels.get("status") == "200"]
assert ok, families["kiln_requests"].samples
print("ALL CHECKS PASSED")
