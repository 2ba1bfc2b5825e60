"""The server's verification rules: each session's rule, chosen at its Open with its preconditions checked here
(`rule_for`), and a step's rules as its sampler asks them (`RuleBatch`). A rule is named, and its parameters and
preconditions listed, in sled/verification.py; here it is a class built from its parameters, with `loose` where it
accepts draft tokens beyond the exact rule."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kernels.rejection_sampler import EXACT, DraftRows, LooseRules
from sled.verification import BY_WIRE, Verification

from .errors import SledError, invalid
from .fly import Fly


class Exact:
    """Lossless: the target's greedy prefix, or rejection sampling against its distribution."""

    name = "exact"
    loose = None  # nothing accepted beyond the exact rule

    def __init__(self, params: Mapping[str, float]):
        self.params = dict(params)


# A rule's name -> its class (each takes its resolved parameters).
RULES = {"exact": Exact, "fly": Fly}


def rule_for(wire: int, given: Mapping[str, float], greedy: bool, config):
    """A session's rule: the one its Open asks for (`wire`, with the parameters `given`), else the server's default
    for a session that does not say (a greedy-only default applies to greedy sessions; others are verified
    exactly). Refused by the server (FAILED_PRECONDITION), not applicable to this session, or with parameters out of
    range (INVALID_ARGUMENT): an error that names it."""
    if wire == 0:  # unspecified
        asked = Verification.parse(config.verification)
        if asked.spec.greedy_only and not greedy:
            asked = Verification()
        given = {}
    else:
        spec = BY_WIRE.get(wire)
        if spec is None:
            known = ", ".join(f"{s.name} {s.wire}" for s in BY_WIRE.values())
            raise invalid(f"verification {wire} is not one this server knows ({known})")
        try:
            asked = Verification(spec.name, dict(given))
        except ValueError as err:
            raise invalid(str(err)) from None
    if asked.name in (config.refuse_verification or ()):
        raise SledError("FAILED_PRECONDITION", f"this server does not allow {asked.name} verification "
                                               "(refuse_verification); open with exact verification")
    try:
        asked.check(greedy)
    except ValueError as err:
        raise invalid(f"{err}: sampling is verified exactly") from None
    params = asked.resolved(config.params_for(asked.name))
    least = asked.spec.min_draft_tokens(params)
    if least > config.max_draft_tokens:
        raise invalid(f"{asked.name} verification needs drafts of {least} tokens, over this server's "
                      f"max_draft_tokens {config.max_draft_tokens} (its {asked.spec.drafts_over} must be below it)")
    return RULES[asked.name](params)


class RuleBatch:
    """A step's sessions' rules, grouped by rule: what the loose ones accept beyond the exact rule (a LooseRules)."""

    def __init__(self, rules: Sequence):
        groups: dict[type, list[int]] = {}
        for i, rule in enumerate(rules):
            if rule.loose is not None:
                groups.setdefault(type(rule), []).append(i)
        self.groups = [(kind, torch.tensor(at, dtype=torch.long), [rules[i] for i in at])
                       for kind, at in groups.items()]

    def apply(self, drafts: DraftRows, accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not accepted.shape[1]:  # no draft tokens in the step: nothing to accept
            return EXACT.apply(drafts, accepted)
        exact = accepted.bool()
        loose = torch.zeros_like(exact)
        for kind, members, rules in self.groups:
            loose |= kind.loose(drafts, exact, members.to(exact.device), rules)
        accepted = accepted | loose.long()
        return accepted, (accepted.cumprod(dim=-1) * loose.long()).sum(dim=-1)


def rule_batch(rules: Sequence) -> LooseRules:
    """The sampler's rules for a step: EXACT where no session has a loose rule."""
    batch = RuleBatch(rules)
    return batch if batch.groups else EXACT
