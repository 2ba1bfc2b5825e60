"""Tool calls under tool_choice "auto": how the target's chat template asks a model to write its calls, and reading
them back out of the text (vLLM's tool parsers play this part). Each format is one object: the instructions it gives
a template that does not render tools itself, how it writes a past call and a function's result into the
conversation, and how it finds calls in an answer, whole or as it streams."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class Call:
    name: str
    arguments: dict

    def openai(self) -> dict:
        """As OpenAI answers a tool call (arguments as a JSON string)."""
        return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}


def _call(obj, names: set[str], args_key: str = "arguments") -> Call | None:
    """A decoded call object as a Call, or None where it is not one of the tools'."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return Call(obj["name"], args) if isinstance(args, dict) else None


class Hermes:
    """Calls as JSON inside <tool_call></tool_call> tags, possibly after some text: Hermes, Qwen 2.5 and 3, SmolLM3,
    and the format SLED teaches a template that has no tools of its own."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _CALLS = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def prompt(self, tools: list[dict]) -> str:
        listed = "\n".join(json.dumps(t) for t in tools)
        return ("# Tools\n\nYou may call one or more functions to answer the user. The functions are listed within "
                f"<tools></tools> tags:\n<tools>\n{listed}\n</tools>\n\nTo call a function, answer with a JSON object "
                "of its name and arguments within <tool_call></tool_call> tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call>')

    def history(self, message: dict) -> dict:
        """A past call or a function's result as a plain message, for a template that renders no tools."""
        if message["role"] == "tool":
            return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
        calls = "\n".join(f"{self.OPEN}\n{json.dumps(c['function'])}\n{self.CLOSE}"
                          for c in message.get("tool_calls") or ())
        return {"role": message["role"], "content": "\n".join(x for x in (message["content"], calls) if x)}

    def parse(self, text: str, names: set[str]) -> tuple[str | None, list[Call]]:
        start = text.find(self.OPEN)
        if start < 0:
            return text, []
        calls = []
        for body in self._CALLS.findall(text[start:]):
            try:
                call = _call(json.loads(body), names)
            except json.JSONDecodeError:
                call = None
            if call is None:  # not a call to one of the tools: the answer is text
                return text, []
            calls.append(call)
        return text[:start].strip() or None, calls

    def split(self, text: str) -> tuple[int, bool]:
        """How much of a streaming answer is surely text, and whether a call begins there."""
        at = text.find(self.OPEN)
        if at >= 0:
            return at, True
        for k in range(min(len(self.OPEN) - 1, len(text)), 0, -1):  # a tag that may be arriving split
            if self.OPEN.startswith(text[-k:]):
                return len(text) - k, False
        return len(text), False


class JsonCalls:
    """An answer that is all calls, as JSON: Llama 3.1-3.3 ({"name", "parameters"}, several joined by ';') and
    Mistral ([TOOL_CALLS] then a list of {"name", "arguments"}); the special tokens before them are not text."""

    def __init__(self, name: str, args_key: str):
        self.name, self.args_key = name, args_key

    def prompt(self, tools: list[dict]) -> str:
        listed = "\n".join(json.dumps(t) for t in tools)
        return (f"You may call these functions:\n{listed}\n\nTo call one, answer only with JSON: "
                f'{{"name": <function-name>, "{self.args_key}": <arguments-object>}}')

    def history(self, message: dict) -> dict:
        if message["role"] == "tool":
            return {"role": "user", "content": f"Function result: {message['content']}"}
        calls = "; ".join(json.dumps({"name": c["function"]["name"], self.args_key: c["function"]["arguments"]})
                          for c in message.get("tool_calls") or ())
        return {"role": message["role"], "content": "\n".join(x for x in (message["content"], calls) if x)}

    def parse(self, text: str, names: set[str]) -> tuple[str | None, list[Call]]:
        body = text.strip().removeprefix("[TOOL_CALLS]").strip()
        decoder, objs, at = json.JSONDecoder(), [], 0
        try:
            while at < len(body):
                obj, at = decoder.raw_decode(body, at)
                objs.extend(obj if isinstance(obj, list) else [obj])
                while at < len(body) and body[at] in " \n\t;,":
                    at += 1
        except json.JSONDecodeError:
            return text, []
        calls = [_call(o, names, self.args_key) for o in objs]
        if not calls or None in calls:
            return text, []
        return None, calls

    def split(self, text: str) -> tuple[int, bool]:
        body = text.lstrip()
        if not body:
            return 0, False  # nothing but space yet: a call may follow
        if body.startswith(("{", "[")):
            return 0, True
        return len(text), False


HERMES = Hermes()
LLAMA3 = JsonCalls("llama3_json", "parameters")
MISTRAL = JsonCalls("mistral", "arguments")


def tool_format(template: str | None):
    """The call format a chat template teaches, by the markers it writes; Hermes's where it has none."""
    template = template or ""
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|python_tag|>" in template or "ipython" in template:
        return LLAMA3
    return HERMES


class CallStream:
    """An auto answer as it streams: text is passed on as it comes, a call is held until the answer ends."""

    def __init__(self, fmt, names: set[str]):
        self.fmt, self.names = fmt, names
        self.text, self.sent, self.calling = "", 0, False

    def feed(self, piece: str) -> str:
        """Of the answer so far, the text that can be sent now."""
        self.text += piece
        if self.calling:
            return ""
        safe, self.calling = self.fmt.split(self.text)
        out, self.sent = self.text[self.sent:safe], max(self.sent, safe)
        return out

    def finish(self) -> tuple[str, list[Call]]:
        """The text held back, and the calls; a call that does not parse is sent as text."""
        _, calls = self.fmt.parse(self.text, self.names)
        return ("", calls) if calls else (self.text[self.sent:], [])
