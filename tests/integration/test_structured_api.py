"""Structured output through the device agent, as apps ask for it with the official openai client: response_format
(a JSON Schema, any JSON object, a pydantic model through parse()), vLLM's structured_outputs extra field (regex,
grammar), plain and streamed, and clear 400s naming the field for what cannot be compiled or sent."""

import json

import pytest
from openai import BadRequestError
from pydantic import BaseModel

from sled.constraints import MAX_CONSTRAINT_BYTES, Constraint
from tests.integration.test_structured import masked_greedy

pytestmark = pytest.mark.model

MODEL = "smollm2-sled"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "colours": {"type": "array", "items": {
    "type": "string"}, "maxItems": 3}}, "required": ["name", "colours"], "additionalProperties": False}


class Country(BaseModel):
    name: str
    capital: str


def test_a_json_schema_answer_is_the_masked_targets_text_plain_and_streamed(agent, target, tokenizer):
    _, _, client = agent
    messages = [{"role": "user", "content": "Name a country and the colours of its flag."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "flag", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0,
                                       response_format=fmt)
    ids = tokenizer.encode(tokenizer.chat_prompt(messages))
    want = masked_greedy(target, ids, Constraint.json_schema(SCHEMA), 64)
    assert r.choices[0].message.content == tokenizer.decode([t for t in want if t not in target.eos_token_ids])
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"name", "colours"} and len(value["colours"]) <= 3
    assert r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0,
                                                 response_format=fmt, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content


def test_parse_with_a_pydantic_model_and_any_json_object(agent):
    _, _, client = agent
    done = client.chat.completions.parse(model=MODEL, max_tokens=64, temperature=0, response_format=Country,
                                         messages=[{"role": "user", "content": "Which country has Paris?"}])
    country = done.choices[0].message.parsed
    assert isinstance(country, Country) and country.name and country.capital
    r = client.chat.completions.create(model=MODEL, max_tokens=160, temperature=0,
                                       response_format={"type": "json_object"},
                                       messages=[{"role": "user", "content": "Give a cat's name and age."}])
    assert r.choices[0].finish_reason == "stop"  # the object closed (a cut one is not JSON: max_tokens bounds it)
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_vllms_structured_outputs_field_takes_a_regex_and_a_grammar(agent):
    _, _, client = agent
    r = client.completions.create(model=MODEL, prompt="Is water wet? Answer:", max_tokens=12, temperature=0,
                                  extra_body={"structured_outputs": {"regex": " (yes|no)\\."}})
    assert r.choices[0].text in (" yes.", " no.")
    r = client.chat.completions.create(
        model=MODEL, max_tokens=16, temperature=0, messages=[{"role": "user", "content": "Pick a colour."}],
        extra_body={"structured_outputs": {"grammar": 'start: "I pick " COLOUR "."\nCOLOUR: "red" | "green"'}})
    assert r.choices[0].message.content in ("I pick red.", "I pick green.")


def test_what_cannot_be_compiled_or_sent_is_a_400_naming_its_field(agent):
    _, _, client = agent
    chat = dict(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    with pytest.raises(BadRequestError, match="'response_format': json_schema: Invalid type: nonsense") as err:
        client.chat.completions.create(**chat, response_format=bad_schema)
    assert err.value.body["param"] == "response_format"
    with pytest.raises(BadRequestError, match="(?s)'structured_outputs': regex: .*unclosed group") as err:
        client.chat.completions.create(**chat, extra_body={"structured_outputs": {"regex": "a(b"}})
    assert err.value.body["param"] == "structured_outputs"
    with pytest.raises(BadRequestError, match="over the limit"):
        client.chat.completions.create(**chat, extra_body={"structured_outputs": {
            "regex": "a" * (MAX_CONSTRAINT_BYTES + 1)}})
    with pytest.raises(BadRequestError, match="not both"):
        client.chat.completions.create(**chat, response_format={"type": "json_object"},
                                       extra_body={"structured_outputs": {"regex": "a"}})
    with pytest.raises(BadRequestError, match="exactly one of json, regex, grammar"):
        client.chat.completions.create(**chat, extra_body={"structured_outputs": {"regex": "a", "grammar": "b"}})
    with pytest.raises(BadRequestError, match="json_schema is given with type json_schema"):
        client.chat.completions.create(**chat, response_format={"type": "json_schema"})


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
NEWS = {"type": "function", "function": {"name": "get_news", "parameters": {
    "type": "object", "properties": {"topic": {"type": "string"}}, "required": ["topic"]}}}


def test_a_forced_tool_call_answers_tool_calls_plain_and_streamed(agent):
    _, _, client = agent
    ask = dict(model=MODEL, max_tokens=64, temperature=0, tools=[WEATHER, NEWS],
               messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    r = client.chat.completions.create(**ask, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    chunks = list(client.chat.completions.create(**ask, stream=True, tool_choice={
        "type": "function", "function": {"name": "get_weather"}}))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert [d.function.name for d in deltas] == ["get_weather"]
    assert json.loads(deltas[0].function.arguments) == args
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    required = client.chat.completions.create(**ask, tool_choice="required").choices[0]
    assert required.finish_reason == "tool_calls"
    assert required.message.tool_calls[0].function.name in ("get_weather", "get_news")
    plain = client.chat.completions.create(**ask, tool_choice="none").choices[0]
    assert plain.message.tool_calls is None and plain.message.content
    # auto: the model is told the tools in the format its template teaches, and may answer either way
    auto = client.chat.completions.create(**ask).choices[0]
    if auto.message.tool_calls:
        assert auto.finish_reason == "tool_calls"
        assert all(c.function.name in ("get_weather", "get_news") for c in auto.message.tool_calls)
    else:
        assert auto.message.content and auto.finish_reason in ("stop", "length")


def test_tool_choices_the_agent_cannot_honour_are_400s(agent):
    _, _, client = agent
    ask = dict(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(BadRequestError, match="names the function 'get_time', which is not among the tools"):
        client.chat.completions.create(**ask, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    with pytest.raises(BadRequestError, match="needs tools"):
        client.chat.completions.create(**ask, tool_choice="required")
    with pytest.raises(BadRequestError, match="'tools': json_schema: "):
        client.chat.completions.create(**ask, tool_choice="required", tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}])
