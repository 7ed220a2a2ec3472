"""Structured outputs through the official `openai` client against a running `kiln serve`:
`client.beta.chat.completions.parse` with pydantic models (greedy and at temperature 1, where
an unconstrained small model rarely writes valid JSON), `json_object`, and vLLM's `guided_regex` /
`guided_choice` through `extra_body`. Every output that ends by itself must validate; one cut by
`max_tokens` must say `length`. Usage: structured_client.py BASE_URL"""

import json
import re
import sys

import openai
import pydantic

base = sys.argv[1]
client = openai.OpenAI(base_url=base + "/v1", api_key="none")
model = client.models.list().data[0].id


# Bounded strings and lists (the schema's maxLength / maxItems, enforced by the mask): a 135M
# model at temperature 1 otherwise writes names until max_tokens cuts them.
class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    kind: str = pydantic.Field(max_length=16)
    age: int = pydantic.Field(ge=0, le=99)


class Household(pydantic.BaseModel):
    family: str = pydantic.Field(max_length=24)
    pets: list[Pet] = pydantic.Field(max_length=3)
    has_garden: bool


ask = [{"role": "user", "content": "Describe a family and its pets as JSON."}]
ended = 0
for temperature, seed in [(0, 0), (1, 1), (1, 2), (1, 3), (1, 4), (1, 5)]:
    for schema in (Pet, Household):
        try:
            r = client.beta.chat.completions.parse(
                model=model, messages=ask, response_format=schema, max_tokens=160,
                temperature=temperature, seed=seed,
            )
        except openai.LengthFinishReasonError as cut:
            # Cut short: reported as such, never passed off as complete.
            print("cut", temperature, seed, schema.__name__, cut.completion.choices[0].message.content)
            continue
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        parsed = choice.message.parsed
        assert isinstance(parsed, schema), choice
        ended += 1
        print("parsed", temperature, seed, schema.__name__, parsed)
assert ended >= 10, f"only {ended} of 12 outputs ended by themselves"

# A cut output reports `length`, and its text is a prefix of valid JSON, not a claim of it.
r = client.chat.completions.create(
    model=model, messages=ask, max_tokens=5, temperature=0,
    response_format={"type": "json_object"},
)
assert r.choices[0].finish_reason == "length", r
assert r.choices[0].message.content.startswith("{"), r

# json_object: any object.
r = client.chat.completions.create(
    model=model, messages=ask, max_tokens=200, temperature=0,
    response_format={"type": "json_object"},
)
if r.choices[0].finish_reason == "stop":
    assert isinstance(json.loads(r.choices[0].message.content), dict), r

# vLLM's fields through extra_body, streamed: the pieces reassemble to a full match.
pieces = []
for chunk in client.chat.completions.create(
    model=model, max_tokens=40, temperature=1, seed=7, stream=True,
    messages=[{"role": "user", "content": "Give me a date."}],
    extra_body={"guided_regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])"},
):
    if chunk.choices and chunk.choices[0].delta.content:
        pieces.append(chunk.choices[0].delta.content)
date = "".join(pieces)
assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])", date), date
r = client.chat.completions.create(
    model=model, max_tokens=10, temperature=1, seed=3,
    messages=[{"role": "user", "content": "Is the sky green?"}],
    extra_body={"guided_choice": ["yes", "no", "it depends"]},
)
assert r.choices[0].message.content in ("yes", "no", "it depends"), r

# An invalid schema is a 400 naming the field.
try:
    client.chat.completions.create(
        model=model, messages=ask, max_tokens=5,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "x", "schema": {"type": "objekt"}}},
    )
    raise AssertionError("an invalid schema was accepted")
except openai.BadRequestError as e:
    assert e.body["param"] == "response_format", e.body
print("ALL CHECKS PASSED")
