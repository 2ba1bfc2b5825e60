"""The device under a constraint: a model drafter masked by it draws only what it allows, and with forced tokens on
takes what it forces after each drawn token without a forward of its own (a key, its quotes and colon after a
value), each with q = 1 on it, so the server's verification stays the standard rule."""

import llguidance
import numpy as np

from edge_client.constrained import Constrained, DraftMask
from edge_client.drafters.base import DrafterOptions
from edge_client.drafters.kv_drafter import KVDrafter
from edge_client.sampling import SamplingParams
from sled.constraints import Constraint

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "population": {
    "type": "integer"}, "capital": {"type": "boolean"}}, "required": ["city", "population", "capital"],
          "additionalProperties": False}
PROMPT = [1, 2, 3]


class FlatDrafter(KVDrafter):
    """Every next-token distribution the same, leaning on a few tokens; counts its forwards and their tokens."""

    name = "flat"

    def __init__(self, vocab: int, eos: int, lean: dict[int, float]):
        super().__init__(DrafterOptions(top_k_cap=64), eos, 4096)
        self.logits = np.zeros(vocab, dtype=np.float32)
        for token, value in lean.items():
            self.logits[token] = value
        self.forwards: list[list[int]] = []

    def _eval(self, tokens):
        self.forwards.append(list(tokens))
        return self.logits.copy()

    def _truncate(self, length):
        pass


def drafter_under(tokenizer, forced: bool, lean: dict[int, float]):
    drafter = FlatDrafter(tokenizer.vocab_size, 2, lean)
    mask = DraftMask(Constraint.json_schema(SCHEMA), tokenizer, len(PROMPT))
    return drafter, Constrained(drafter, mask, masked=True, forced=forced)


def fits(tokenizer, tokens) -> bool:
    matcher = llguidance.LLMatcher(tokenizer.grammar_tokenizer, Constraint.json_schema(SCHEMA).grammar(), log_level=0)
    return all(matcher.consume_token(t) for t in tokens)


def test_tokens_forced_after_drawn_ones_are_taken_without_a_forward(tokenizer):
    lean = {tokenizer.encode(s)[-1]: 5.0 for s in ("1", "true")}  # a drafter that likes digits and true
    plain, masked = drafter_under(tokenizer, False, lean)
    jumping, jumped = drafter_under(tokenizer, True, lean)
    for d, c in ((plain, masked), (jumping, jumped)):
        c.begin(PROMPT, SamplingParams(temperature=0.0))
    a = masked.propose(PROMPT, 24)
    b = jumped.propose(PROMPT, 24)
    assert fits(tokenizer, a.token_ids) and fits(tokenizer, b.token_ids)
    assert masked.forced_tokens == 0 and len(a.token_ids) == 24
    # '{"city": "' is forced at the start; later keys are forced after the values the drafter draws
    start = len(DraftMask(Constraint.json_schema(SCHEMA), tokenizer, 3).forced(PROMPT))
    assert start > 0 and jumped.forced_tokens > start
    drawn = len(b.token_ids) - jumped.forced_tokens
    # one forward for the context and the start's forced tokens, then one per drawn token but the draft's last,
    # the tokens forced after it riding along in the same forward
    assert jumping.forwards[0] == PROMPT + b.token_ids[:start]
    assert sum(jumping.forwards[1:], []) == b.token_ids[start:-1]
    assert len(jumping.forwards) == drawn and max(len(f) for f in jumping.forwards[1:]) > 1
    assert b.confidence.count(1.0) >= jumped.forced_tokens


def test_sampled_forced_tokens_go_out_with_q_one_on_them(tokenizer):
    lean = {tokenizer.encode(s)[-1]: 3.0 for s in ("7", "false")}
    _, jumped = drafter_under(tokenizer, True, lean)
    jumped.begin(PROMPT, SamplingParams(temperature=1.0, seed=5))
    proposal = jumped.propose(PROMPT, 24)
    assert fits(tokenizer, proposal.token_ids) and jumped.forced_tokens > 0
    forced_q = [proposal.q(i) for i in range(len(proposal.token_ids)) if proposal.q(i)[0].size == 1]
    assert len(forced_q) >= jumped.forced_tokens
    assert all(probs[0] == 1.0 for _, probs in forced_q)
    mid = [i for i in range(1, len(proposal.token_ids)) if proposal.q(i)[0].size == 1
           and proposal.q(i - 1)[0].size > 1]  # a forced token right after a drawn one: a jump mid-draft
    assert mid and all(proposal.q(i)[0][0] == proposal.token_ids[i] for i in mid)
