"""Constraints at the verifier: compiled once by hash, a clear error for one that does not compile, and the logits
of every draft position masked with what the constraint allows after the draft's tokens before it."""

import json

import pytest
import torch

from sled.constraints import MAX_CONSTRAINT_BYTES, Constraint
from verify_server.constraint import Grammars, commit
from verify_server.errors import SledError

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def hf():
    from verify_server.model_loader import vocabulary_tokenizer

    return vocabulary_tokenizer(None)  # the default GGUF's vocabulary


@pytest.fixture(scope="module")
def grammars(hf):
    return Grammars(hf, len(hf), (hf.eos_token_id,))


def allowed(row: torch.Tensor) -> set[int]:
    """The ids a masked row leaves: masked ones hold the lowest finite logit (probability 0 after softmax)."""
    return set((row > torch.finfo(row.dtype).min).nonzero().flatten().tolist())


def test_a_constraint_out_of_bounds_or_of_an_unknown_kind_is_refused_before_it_reaches_the_library():
    with pytest.raises(ValueError, match="over the limit"):
        Constraint("regex", "a" * (MAX_CONSTRAINT_BYTES + 1))
    with pytest.raises(ValueError, match="one of json_schema"):
        Constraint("xml", "<a/>")
    with pytest.raises(ValueError, match="json_schema is not JSON"):
        Constraint("json_schema", "{nope")
    with pytest.raises(ValueError, match="needs its text"):
        Constraint("regex", "")


def test_one_that_does_not_compile_is_invalid_argument_with_the_librarys_message(grammars):
    for constraint, message in ((Constraint("regex", "a(b"), "unclosed group"),
                                (Constraint("json_schema", '{"type": "nonsense"}'), "nonsense"),
                                (Constraint("lark", "start: missing_rule"), "missing_rule")):
        with pytest.raises(SledError) as err:
            grammars.matcher(constraint)
        assert err.value.code == "INVALID_ARGUMENT" and message in err.value.message
        assert err.value.message.startswith(f"constraint {constraint.kind}: ")


def test_sessions_sharing_a_constraint_compile_it_once_and_each_gets_its_own_state(grammars, hf):
    before = len(grammars._compiled)
    a = grammars.matcher(Constraint.json_schema(SCHEMA))
    b = grammars.matcher(Constraint.json_schema(SCHEMA))
    assert len(grammars._compiled) == before + 1
    commit(a, hf.encode('{"name'))
    logits = torch.zeros(2, len(hf))
    grammars.mask(logits, [(a, 0, []), (b, 1, [])])
    assert allowed(logits[0]) != allowed(logits[1])  # a moved on, b is still at the start


def test_every_draft_position_is_masked_after_the_drafts_tokens_before_it_and_the_state_is_kept(grammars, hf):
    m = grammars.matcher(Constraint.json_schema(SCHEMA))
    good = hf.encode('{"name": "Al", "age": 3')
    logits = torch.zeros(len(good) + 1, len(hf))
    grammars.mask(logits, [(m, 0, good)])
    for i, tok in enumerate(good):
        assert tok in allowed(logits[i]), (i, hf.decode([tok]))
    assert allowed(logits[0]) <= set(hf.encode("{")) | set(hf.encode('{"'))  # an object opens
    digits = allowed(logits[len(good)])
    assert hf.encode("}")[0] in digits and hf.encode(" \"")[0] not in digits  # after 3: more digits, or the end
    # the matcher was only looked through: it is still at the start, and the same draft masks the same way
    again = torch.zeros_like(logits)
    grammars.mask(again, [(m, 0, good)])
    assert torch.equal(again, logits)


def test_past_a_forbidden_draft_token_the_rows_are_left_and_the_forbidden_token_is_masked_in_its_row(grammars, hf):
    m = grammars.matcher(Constraint.json_schema(SCHEMA))
    opening = hf.encode('{"')
    bad = hf.encode("x")[0]  # no key but name and age starts with x
    draft = opening + [bad] + hf.encode("yz")
    logits = torch.zeros(len(draft) + 1, len(hf))
    grammars.mask(logits, [(m, 0, draft)])
    assert bad not in allowed(logits[len(opening)])
    for row in logits[len(opening) + 1:]:
        assert allowed(row) == set(range(len(hf)))  # never read: verification stops at the forbidden token


def test_only_the_constrained_rows_of_a_step_are_masked(grammars, hf):
    m = grammars.matcher(Constraint("regex", "[0-9]+"))
    draft = hf.encode("12")
    assert len(draft) == 2
    logits = torch.zeros(6, len(hf) + 64)  # the target's embedding may have padding rows past the tokenizer's ids
    grammars.mask(logits, [(m, 3, draft)])
    for free in logits[:3]:
        assert torch.equal(free, torch.zeros_like(free))
    digit = hf.encode("7")[0]
    assert all(digit in allowed(row) and hf.encode("a")[0] not in allowed(row) for row in logits[3:6])
    assert not set(range(len(hf), len(hf) + 64)) & allowed(logits[3])  # padding ids are never allowed
    assert torch.isfinite(logits).all()  # masked, not infinite: the sampler reads an infinite logit as broken
    assert torch.softmax(logits[3], -1)[hf.encode("a")[0]] == 0


def test_a_reopen_resumes_the_constraint_after_the_tokens_generated_so_far(grammars, hf):
    done = hf.encode('{"name": "Al"')
    m = grammars.matcher(Constraint.json_schema(SCHEMA), done)
    logits = torch.zeros(1, len(hf))
    grammars.mask(logits, [(m, 0, [])])
    assert hf.encode(",")[0] in allowed(logits[0]) and hf.encode("{")[0] not in allowed(logits[0])
    with pytest.raises(SledError, match="do not fit it"):
        grammars.matcher(Constraint.json_schema(SCHEMA), hf.encode("hello"))


def test_a_json_object_constraint_allows_any_object(grammars, hf):
    m = grammars.matcher(Constraint("json_object"))
    commit(m, hf.encode(json.dumps({"anything": [1, 2, {"x": None}]})))
    assert m.is_accepting()


def test_the_eos_that_ends_a_finished_grammar_commits(grammars, hf):
    """A grammar that can take nothing more allows EOS alone; committing it must not fail (the library's
    consume_tokens refuses it where consume_token takes it)."""
    m = grammars.matcher(Constraint("regex", "(yes|no)\\."))
    commit(m, hf.encode("yes."))
    logits = torch.zeros(1, len(hf))
    grammars.mask(logits, [(m, 0, [])])
    assert allowed(logits[0]) == {hf.eos_token_id}
    commit(m, [hf.eos_token_id])
    assert not m.is_error()
