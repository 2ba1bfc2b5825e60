"""tool_choice "auto": the call formats chat templates teach, read back from whole and streamed answers, and the
daemon's answers to them (message.tool_calls, tool-call deltas, text where no call parses), before an agent whose
generation is scripted."""

import asyncio
import json
from types import SimpleNamespace

import pytest
from aiohttp.test_utils import TestClient, TestServer
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from edge_client.agent import Completion
from edge_client.openai_api import OpenAIServer
from edge_client.result import GenerationResult
from edge_client.tokenizer import render_chat, takes_tools
from edge_client.tool_calls import HERMES, LLAMA3, MISTRAL, Call, CallStream, tool_format

NAMES = {"get_weather", "get_news"}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}
NEWS = {"type": "function", "function": {"name": "get_news", "parameters": {"type": "object", "properties": {}}}}
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# A template that renders the tools and past calls itself, as Qwen 2.5's does
WITH_TOOLS = ("{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
              " — answer calls in <tool_call></tool_call> tags<|im_end|>\n{% endif %}"
              "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
              "{% for c in m.get('tool_calls', []) %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
              "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_hermes_calls_are_read_after_text_and_unclosed_at_the_end():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_news", "arguments": "{}"}')  # the last one cut at EOS, its args a string
    content, calls = HERMES.parse(text, NAMES)
    assert content == "Let me look."
    assert calls == [Call("get_weather", {"city": "Paris"}), Call("get_news", {})]
    assert HERMES.parse("<tool_call>\n{}</tool_call>", NAMES) == ("<tool_call>\n{}</tool_call>", [])
    for text in ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',  # not one of the tools
                 '<tool_call>{"name": "get_news", "arguments": {</tool_call>',  # not JSON
                 "The weather is fine."):
        assert HERMES.parse(text, NAMES) == (text, [])


def test_json_call_formats_of_llama3_and_mistral():
    content, calls = LLAMA3.parse(' {"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                                  '{"name": "get_news", "parameters": {}}', NAMES)
    assert content is None and calls == [Call("get_weather", {"city": "Oslo"}), Call("get_news", {})]
    content, calls = MISTRAL.parse('[TOOL_CALLS][{"name": "get_news", "arguments": {"topic": "rain"}}]', NAMES)
    assert content is None and calls == [Call("get_news", {"topic": "rain"})]
    for text in ("It is sunny.", '{"name": "get_weather", "parameters": {"city": ', '{"city": "Oslo"}'):
        assert LLAMA3.parse(text, NAMES) == (text, [])


def test_the_format_is_the_one_the_template_teaches():
    assert tool_format("... [TOOL_CALLS] ...") is MISTRAL
    assert tool_format("{{ '<|python_tag|>' }} ipython") is LLAMA3
    assert tool_format("<tool_call>") is HERMES and tool_format(CHATML) is HERMES and tool_format(None) is HERMES


def test_a_stream_passes_text_on_and_holds_a_call_even_when_its_tag_arrives_split():
    held = CallStream(HERMES, NAMES)
    sent = [held.feed(p) for p in ("Sure", ". <to", "ol_call>\n{\"name\": \"get_weather\", ",
                                   "\"arguments\": {\"city\": \"Rome\"}}\n</tool_call>")]
    assert sent == ["Sure", ". ", "", ""]
    assert held.finish() == ("", [Call("get_weather", {"city": "Rome"})])
    text = CallStream(HERMES, NAMES)
    assert [text.feed(p) for p in ("a <to", "ols are> b")] == ["a ", "<tools are> b"]
    assert text.finish() == ("", [])
    broken = CallStream(LLAMA3, NAMES)
    assert [broken.feed(p) for p in ("  ", '{"name": "nope"', "}")] == ["", "", ""]
    assert broken.finish() == ('  {"name": "nope"}', [])  # not a call after all: sent as text at the end


def test_a_template_that_renders_tools_gets_them_and_one_that_does_not_is_told_in_a_system_message():
    assert takes_tools(WITH_TOOLS) and not takes_tools(CHATML)
    text = render_chat(WITH_TOOLS, [{"role": "user", "content": "hi"}], tools=[WEATHER, NEWS])
    assert text.startswith("<|im_start|>system\nTOOLS: get_weather get_news")
    assert "TOOLS" not in render_chat(WITH_TOOLS, [{"role": "user", "content": "hi"}])
    told = HERMES.prompt([WEATHER])
    assert json.dumps(WEATHER) in told and "<tool_call>" in told


class ScriptedAgent:
    """Before the real API handlers: a tokenizer that renders a given template and an answer scripted per request."""

    def __init__(self, template: str, answer: str):
        self.answer, self.prompts = answer, []
        self.config = SimpleNamespace(model_name="m", http_api_key=None, default_max_tokens=64, server="-",
                                      drafter="-")
        self.policy = SimpleNamespace(check=lambda sampling: None)
        self.tokenizer = SimpleNamespace(chat_template=template, path=SimpleNamespace(name="m.gguf"),
                                         chat_prompt=self._chat_prompt, encode=lambda text: [1, 2, 3])

    def _chat_prompt(self, messages, tools=None):
        self.prompts.append(render_chat(self.tokenizer.chat_template, messages, tools=tools))
        return self.prompts[-1]

    def busy(self):
        return None

    def request(self, prompt_ids, sampling, max_tokens, constraint=None):
        return SimpleNamespace(prompt_token_ids=prompt_ids, max_tokens=max_tokens, constraint=constraint)

    async def check_fits(self, prompt_tokens, max_tokens):
        pass

    async def complete(self, asked, stops, on_text=None, gone=None):
        for i in range(0, len(self.answer), 5):  # the answer as it would stream, in pieces
            if on_text is not None:
                on_text(self.answer[i:i + 5], True)
            await asyncio.sleep(0)
        result = GenerationResult(prompt_token_ids=asked.prompt_token_ids, token_ids=[7] * 9, text=self.answer)
        return Completion(result, self.answer, "stop")


def ask(agent, body):
    async def go():
        async with TestClient(TestServer(OpenAIServer(agent).app)) as client:
            resp = await client.post("/v1/chat/completions", json=body)
            return resp.status, await resp.text()

    return asyncio.run(go())


def chunks(text):
    return [ChatCompletionChunk.model_validate(json.loads(line[6:])) for line in text.splitlines()
            if line.startswith("data: {")]


CALL = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
BODY = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER, NEWS]}


@pytest.mark.parametrize("choice", [None, "auto"])
def test_auto_answers_a_call_as_tool_calls_and_text_as_content(choice):
    body = dict(BODY, tool_choice=choice) if choice else BODY
    agent = ScriptedAgent(CHATML, CALL)
    status, text = ask(agent, body)
    assert status == 200, text
    (answer,) = ChatCompletion.model_validate_json(text).choices
    assert answer.finish_reason == "tool_calls" and answer.message.content == "Checking."
    (call,) = answer.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert json.dumps(WEATHER) in agent.prompts[0]  # the template has no tools: told them in a system message
    status, text = ask(ScriptedAgent(CHATML, "It is sunny in Paris."), body)
    (answer,) = ChatCompletion.model_validate_json(text).choices
    assert (answer.finish_reason, answer.message.content, answer.message.tool_calls) == (
        "stop", "It is sunny in Paris.", None)


def test_auto_streams_text_as_it_comes_and_a_call_as_tool_call_deltas():
    status, text = ask(ScriptedAgent(CHATML, CALL), dict(BODY, stream=True))
    got = chunks(text)
    assert status == 200
    assert "".join(c.choices[0].delta.content or "" for c in got) == "Checking.\n"
    (delta,) = [d for c in got for d in c.choices[0].delta.tool_calls or ()]
    assert delta.index == 0 and delta.id.startswith("call_") and delta.function.name == "get_weather"
    assert json.loads(delta.function.arguments) == {"city": "Paris"}
    assert got[-1].choices[0].finish_reason == "tool_calls"
    status, text = ask(ScriptedAgent(CHATML, "<tool_call> is how I call."), dict(BODY, stream=True))
    got = chunks(text)  # a tag, but no call: the held text goes out as content
    assert "".join(c.choices[0].delta.content or "" for c in got) == "<tool_call> is how I call."
    assert got[-1].choices[0].finish_reason == "stop"


def test_past_calls_and_results_reach_the_template_in_its_own_way_or_as_the_formats_text():
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C, clear"}]
    agent = ScriptedAgent(CHATML, "It is 18 C.")
    assert ask(agent, dict(BODY, messages=history))[0] == 200
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in agent.prompts[0]
            and "<|im_start|>user\n<tool_response>\n18 C, clear\n</tool_response>" in agent.prompts[0])
    native = ScriptedAgent(WITH_TOOLS, "It is 18 C.")
    assert ask(native, dict(BODY, messages=history))[0] == 200
    assert native.prompts[0].startswith("<|im_start|>system\nTOOLS: get_weather get_news")
    assert '<tool_call>{"arguments": {"city": "Paris"}, "name": "get_weather"}</tool_call>' in native.prompts[0]
    assert "<|im_start|>tool\n18 C, clear" in native.prompts[0]
    bad = [history[0], dict(history[1], tool_calls=[dict(history[1]["tool_calls"][0], function={
        "name": "get_weather", "arguments": "{city"})])]
    status, text = ask(agent, dict(BODY, messages=bad))
    assert status == 400 and "a tool call's arguments are not JSON" in json.loads(text)["error"]["message"]
    status, text = ask(agent, dict(BODY, messages=[{"role": "tool", "content": None}]))
    assert status == 400 and "content is required" in json.loads(text)["error"]["message"]
