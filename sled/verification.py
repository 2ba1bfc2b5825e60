"""Verification rules as both sides name them: each rule's wire value, parameters and preconditions, and a rule
chosen with its parameters (`Verification`), written NAME or NAME:KEY=VALUE,... (`fly:window=4`).

The server's implementation of each rule is in verify_server/verification.py; a new rule adds its entry here, its
module and a registry line there, and its value in the proto's Verification enum."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from sled.v1 import verify_pb2 as pb


@dataclass(frozen=True)
class Param:
    default: float
    low: float  # the value must be in [low, high)
    high: float
    integer: bool
    help: str


@dataclass(frozen=True)
class RuleSpec:
    name: str
    wire: int  # its pb.Verification value
    summary: str
    lossless: bool = True  # whether the text is exactly the target's
    greedy_only: bool = False
    params: Mapping[str, Param] = field(default_factory=dict)
    # the parameter that a draft must be longer than for the rule to judge it (FLy's window), or None
    drafts_over: str | None = None

    def min_draft_tokens(self, params: Mapping[str, float]) -> int:
        """The shortest draft the rule makes use of, with these parameters (0: any)."""
        return int(params[self.drafts_over]) + 1 if self.drafts_over else 0


RULES: dict[str, RuleSpec] = {spec.name: spec for spec in (
    RuleSpec("exact", pb.VERIFICATION_EXACT, "lossless: the text is exactly the target's"),
    RuleSpec("fly", pb.VERIFICATION_FLY,
             "FLy (Li et al. 2025), loose, greedy only: a mismatch is accepted where the target is unsure there and "
             "agrees with the draft on the next window - 1 tokens; the text is no longer exactly the target's",
             lossless=False, greedy_only=True,
             params={"window": Param(6, 1, 64, True, "deferred window W: never a mismatch in a draft's last W "
                                                      "positions, so drafts need more than W tokens"),
                     "entropy_threshold": Param(0.3, 0, 10, False, "nats over the target's three most likely "
                                                                    "tokens at the mismatch, at least this")},
             drafts_over="window"),
)}

BY_WIRE = {spec.wire: spec for spec in RULES.values()}


def rules_help() -> str:
    """The rules and their parameters, for a --verification flag's help."""
    parts = []
    for spec in RULES.values():
        params = ", ".join(f"{k} (default {p.default:g}): {p.help}" for k, p in spec.params.items())
        parts.append(f"{spec.name}: {spec.summary}" + (f"; parameters {params}" if params else ""))
    return "; ".join(parts)


@dataclass(frozen=True)
class Verification:
    """A rule and the parameters given for it (the rest take their defaults where the rule is applied)."""

    name: str = "exact"
    params: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        spec = RULES.get(self.name)
        if spec is None:
            raise ValueError(f"verification {self.name!r} is not a rule: one of {', '.join(RULES)}")
        for key, value in self.params.items():
            p = spec.params.get(key)
            if p is None:
                known = ", ".join(spec.params) or "none"
                raise ValueError(f"{self.name} verification has no parameter {key!r} (its parameters: {known})")
            if not (math.isfinite(value) and p.low <= value < p.high) or (p.integer and value != int(value)):
                kind = "an integer" if p.integer else "a number"
                raise ValueError(f"{self.name}'s {key} must be {kind} in [{p.low:g}, {p.high:g}), got {value:g}")

    @classmethod
    def parse(cls, text: str) -> Verification:
        """NAME or NAME:KEY=VALUE,...; ValueError naming what is wrong."""
        name, _, rest = text.strip().partition(":")
        params = {}
        for item in filter(None, (x.strip() for x in rest.split(","))):
            key, eq, value = item.partition("=")
            try:
                params[key.strip()] = float(value)
            except ValueError:
                raise ValueError(f"verification {text!r}: {item!r} is not KEY=NUMBER") from None
            if not eq:
                raise ValueError(f"verification {text!r}: {item!r} is not KEY=NUMBER")
        return cls(name.strip(), params)

    @property
    def spec(self) -> RuleSpec:
        return RULES[self.name]

    @property
    def wire(self) -> int:
        return self.spec.wire

    def check(self, greedy: bool) -> None:
        """The rule's preconditions for a request: ValueError where it cannot apply."""
        if self.spec.greedy_only and not greedy:
            raise ValueError(f"{self.name} verification applies to greedy generation (temperature 0) only")

    def resolved(self, *under: Mapping[str, float]) -> dict[str, float]:
        """Every parameter's value: these given ones over `under` (each over the one before) over the defaults."""
        values = {k: p.default for k, p in self.spec.params.items()}
        for given in (*under, self.params):
            values.update(given)
        return values

    def __str__(self) -> str:
        return self.name + (":" + ",".join(f"{k}={v:g}" for k, v in self.params.items()) if self.params else "")
