"""The local API's requests as typed models (pydantic, as OpenAI-compatible servers validate them)."""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from sled.constraints import Constraint

Temperature = Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=1, le=2**31 - 1)]
UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "suffix", "functions")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    schema_: dict | bool = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: free text, any JSON object, or JSON that fits a schema."""
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type json_schema, and only then")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs extra field, one of: json (a JSON Schema), regex, grammar (Lark, llguidance's
    dialect)."""
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    json_: dict | bool | None = Field(None, alias="json")
    regex: str | None = None
    grammar: str | None = None

    @model_validator(mode="after")
    def _one(self):
        if sum(x is not None for x in (self.json_, self.regex, self.grammar)) != 1:
            raise ValueError("give exactly one of json, regex, grammar")
        return self


class Function(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: Function


class NamedTool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: dict[Literal["name"], str]


class _Request(BaseModel):
    """What completions and chat completions share. Fields the agent does not act on are ignored, as OpenAI's
    optional ones (user, presence_penalty, ...); those whose answer it cannot give are refused."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None  # vLLM's extension
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    max_tokens: Count | None = None
    stop: Annotated[str, Field(min_length=1)] | Annotated[list[str], Field(max_length=4)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=1)] | None = None  # one choice a request (an int: strict refuses true)
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's extension

    @model_validator(mode="after")
    def _supported(self):
        extra = self.model_extra or {}
        asked = [k for k in UNSUPPORTED if extra.get(k) not in (None, False, 0, [], {})]
        if asked:
            raise ValueError(f"{', '.join(asked)} not supported by the SLED device agent")
        return self

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def constraint_field(self) -> str | None:
        """The field that asks for structured output (response_format or structured_outputs), or None."""
        asked = [field for field, value in (("response_format", getattr(self, "response_format", None)),
                                            ("structured_outputs", self.structured_outputs))
                 if value is not None and getattr(value, "type", None) != "text"]
        if len(asked) > 1:
            raise ValueError("give response_format or structured_outputs, not both")
        return asked[0] if asked else None

    def constraint(self) -> Constraint | None:
        """What the text must match; ValueError, naming its field, for one past the wire's limits."""
        field = self.constraint_field()
        value = getattr(self, field) if field else None
        try:
            if field == "response_format":
                return (Constraint("json_object") if value.type == "json_object"
                        else Constraint.json_schema(value.json_schema.schema_))
            if field == "structured_outputs":
                if value.json_ is not None:
                    return Constraint.json_schema(value.json_)
                return Constraint("regex", value.regex) if value.regex is not None else Constraint("lark", value.grammar)
        except ValueError as err:
            raise ValueError(f"'{field}': {err}") from None
        return None


class CompletionRequest(_Request):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[str], Field(min_length=1, max_length=1)] | \
        Annotated[list[Annotated[int, Field(ge=0, le=2**31 - 1)]], Field(min_length=1)]

    @property
    def text(self) -> str | None:
        """The prompt as text, or None where it came as token ids."""
        if isinstance(self.prompt, str):
            return self.prompt
        return self.prompt[0] if isinstance(self.prompt[0], str) else None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: Annotated[str, Field(min_length=1, max_length=64)]
    arguments: str  # JSON, as the call was answered


class PastCall(BaseModel):
    """A tool call an earlier assistant message made, sent back in the conversation."""
    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    type: Literal["function"]
    function: CalledFunction


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[PastCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required, except in an assistant message that makes tool calls")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message makes tool calls")
        return self

    def plain(self) -> dict:
        """The message for the chat template: developer taken as system, text parts joined, a past call's arguments
        decoded (as Hugging Face's templates take them)."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or ())
        out = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            try:
                out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in self.tool_calls]
            except json.JSONDecodeError as err:
                raise ValueError(f"a tool call's arguments are not JSON: {err}") from None
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatRequest(_Request):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Count | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None

    @model_validator(mode="after")
    def _tool_choice(self):
        names = [t.function.name for t in self.tools or ()]
        if isinstance(self.tool_choice, NamedTool) and self.tool_choice.function["name"] not in names:
            raise ValueError(f"tool_choice names the function {self.tool_choice.function['name']!r}, which is not "
                             f"among the tools ({', '.join(names) or 'none given'})")
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        return self

    def auto_tools(self) -> list[dict]:
        """The tools the model may call or not (tool_choice auto, the default with tools), as templates take them."""
        if not self.tools or self.tool_choice not in (None, "auto"):
            return []
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def forced_tools(self) -> list[Function]:
        """The functions one of which the answer must call ('required', or the one named), none otherwise."""
        if isinstance(self.tool_choice, NamedTool):
            return [t.function for t in self.tools if t.function.name == self.tool_choice.function["name"]]
        return [t.function for t in self.tools] if self.tool_choice == "required" else []

    def constraint_field(self) -> str | None:
        if self.forced_tools():
            if super().constraint_field() is not None:
                raise ValueError("a forced tool call takes no response_format or structured_outputs")
            return "tools"
        return super().constraint_field()

    def constraint(self) -> Constraint | None:
        """A forced tool call: the function's name and its arguments, as JSON ({"name": ..., "arguments": ...})."""
        tools = self.forced_tools()
        if not tools:
            return super().constraint()
        calls = [{"type": "object", "properties": {"name": {"const": f.name}, "arguments": f.parameters},
                  "required": ["name", "arguments"], "additionalProperties": False} for f in tools]
        try:
            return Constraint.json_schema(calls[0] if len(calls) == 1 else {"anyOf": calls})
        except ValueError as err:
            raise ValueError(f"'tools': {err}") from None

    def tool_prompt(self) -> str | None:
        """What the model is told of the functions it must call (a system message), or None."""
        tools = self.forced_tools()
        if not tools:
            return None
        listed = "\n".join(json.dumps({"name": f.name, "description": f.description or "", "parameters": f.parameters})
                           for f in tools)
        return ("You call functions. Answer with one call, as JSON: {\"name\": NAME, \"arguments\": {...}}. "
                "The functions:\n" + listed)


def first_problem(err: ValidationError) -> tuple[str, str | None]:
    """A validation error as OpenAI states one: a message and the parameter it is about."""
    problems = err.errors(include_url=False)
    # Of a union's branches, the one whose type fits the input says what is wrong with it: a constraint it failed
    # (too long, too large), not that it is not some other type.
    fitting = [p for p in problems if not p["type"].endswith("_type") and p["type"] != "literal_error"]
    first = (fitting or problems)[0]
    loc = [str(p) for p in first["loc"] if not str(p).startswith(("function-", "constrained-", "union["))]
    param = loc[0] if loc else None
    where = ".".join(loc)
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "json_invalid":
        return "the request body is not valid JSON", None
    if first["type"] == "model_type" and not loc:
        return "the request body must be a JSON object", None
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return (f"'{where}': {message}{more}" if where else f"{message}{more}"), param
