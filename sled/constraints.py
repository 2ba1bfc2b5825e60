"""A constraint on the generated text (structured output), as both sides name it: its kind, its text, the size the
wire allows, and its grammar in llguidance's terms. The server compiles and enforces it (verify_server/constraint.py);
the device checks it compiles before it sends it."""

from __future__ import annotations

import json
from dataclasses import dataclass

from sled.v1.limits import MAX_CONSTRAINT_BYTES

# The kinds, as the wire's Constraint.kind names them: a JSON Schema (JSON text), any JSON object, a regular
# expression, a Lark grammar (llguidance's dialect, which also reads GBNF converted to Lark).
KINDS = ("json_schema", "json_object", "regex", "lark")
# JSON comes out on one line with ", " and ": " between items (as json.dumps writes it): the grammar then forces every
# key, quote and colon, which a device drafts without its drafter, and a small model cannot loop on whitespace.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Constraint:
    kind: str
    text: str = ""  # empty for json_object

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"constraint kind {self.kind!r}: one of {', '.join(KINDS)}")
        size = len(self.text.encode())
        if size > MAX_CONSTRAINT_BYTES:
            raise ValueError(f"a {self.kind} constraint of {size} bytes is over the limit of {MAX_CONSTRAINT_BYTES}")
        if self.kind == "json_object" and self.text:
            raise ValueError("a json_object constraint has no text")
        if self.kind != "json_object" and not self.text:
            raise ValueError(f"a {self.kind} constraint needs its text")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.text)
            except json.JSONDecodeError as err:
                raise ValueError(f"json_schema is not JSON: {err}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("json_schema must be a JSON object (or true / false)")

    @classmethod
    def json_schema(cls, schema: dict | bool) -> Constraint:
        return cls("json_schema", json.dumps(schema))

    def grammar(self) -> str:
        """The constraint as an llguidance grammar; ValueError with the library's message where it does not compile
        (checked without a tokenizer: what every tokenizer would refuse)."""
        import llguidance

        m = llguidance.LLMatcher
        try:
            if self.kind == "json_schema":
                grammar = m.grammar_from_json_schema(self.text, overrides=JSON_LAYOUT)
            elif self.kind == "json_object":
                grammar = m.grammar_from_json_schema(json.dumps({"type": "object"}), overrides=JSON_LAYOUT)
            elif self.kind == "regex":
                grammar = m.grammar_from_regex(self.text)
            else:
                grammar = m.grammar_from_lark(self.text)
        except ValueError as err:
            raise ValueError(f"{self.kind}: {err}") from None
        error = m.validate_grammar(grammar)
        if error:
            raise ValueError(f"{self.kind}: {error}")
        return grammar
