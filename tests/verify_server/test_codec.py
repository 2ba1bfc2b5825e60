import math

import pytest

from sled.v1 import verify_pb2 as pb
from verify_server.codec import draft_from_pb, open_from_pb, verdict_to_pb
from verify_server.config import ServerConfig
from verify_server.errors import SledError
from verify_server.sessions import Verdict

CONFIG = ServerConfig(max_seq_len=64)


def draft(tokens, offsets=None, ids=None, probs=None):
    msg = pb.Draft(session_id="s", round=3, token_ids=tokens)
    if offsets is not None:
        msg.draft_probs.CopyFrom(pb.SparseDistributions(offsets=offsets, token_ids=ids, probs=probs))
    return msg


def test_sparse_distributions_stay_sparse_until_the_step_pads_them():
    d = draft_from_pb(draft([4, 7], [0, 2, 3], [4, 5, 7], [0.75, 0.25, 1.0]), 100, 8, 8)
    assert d.token_ids == (4, 7) and d.round == 3
    assert d.q.counts.tolist() == [2, 1] and d.q.ids.tolist() == [4, 5, 7]
    assert d.q.probs.tolist() == [0.75, 0.25, 1.0]


def test_deterministic_draft_has_no_q():
    assert draft_from_pb(draft([4, 7]), 100, 8, 8).q is None


@pytest.mark.parametrize("msg,needle", [
    (draft([1] * 9), "longer than the server's max_draft_tokens=8"),
    (draft([100]), "out of range"),
    (draft([1], [0, 1, 2], [1, 2], [0.5, 0.5]), "malformed"),
    (draft([1], [0, 2], [1, 2], [math.nan, 0.5]), "finite"),
    (draft([1], [0, 2], [1, 2], [-0.1, 1.1]), "[0, 1]"),
    (draft([1], [0, 2], [1, 2], [0.2, 0.2]), "sum to 1"),
    (draft([1], [0, 2], [1, 200], [0.5, 0.5]), "out of range"),
    (draft([1], [0, 0], [], []), "1 to 8"),
])
def test_bad_drafts_are_invalid_argument(msg, needle):
    with pytest.raises(SledError) as err:
        draft_from_pb(msg, 100, 8, 8)
    assert err.value.code == "INVALID_ARGUMENT" and needle in err.value.message


@pytest.mark.parametrize("sampling,needle", [
    (pb.SamplingParams(temperature=-1), "temperature"),
    (pb.SamplingParams(temperature=math.nan), "temperature"),
    (pb.SamplingParams(top_p=1.5), "top_p"),
])
def test_bad_sampling_is_invalid_argument(sampling, needle):
    with pytest.raises(SledError) as err:
        open_from_pb(pb.Open(context_token_ids=[1], max_tokens=1, sampling=sampling), 100, CONFIG)
    assert err.value.code == "INVALID_ARGUMENT" and needle in err.value.message


def test_verdict_without_next_token_leaves_the_field_unset():
    msg = verdict_to_pb(Verdict(2, 1, None, True, "stop")).verdict
    assert not msg.HasField("next_token") and msg.finished and msg.finish_reason == pb.FINISH_REASON_STOP
    assert verdict_to_pb(Verdict(2, 1, 0, False, None)).verdict.HasField("next_token")


@pytest.mark.parametrize("fields,needle", [
    (dict(context_token_ids=[]), "context_token_ids is empty"),
    (dict(context_token_ids=[1] * 64), "prompt of 64 tokens is over the context limit: at most 63 tokens"),
    (dict(context_token_ids=[1, 100]), "prompt token id 100 out of range"),
    (dict(context_token_ids=[1], stop_token_ids=[100]), "stop token id 100 out of range"),
    (dict(context_token_ids=[1], stop_token_ids=list(range(257))), "257 stop token ids: at most 256"),
    (dict(context_token_ids=[1], max_tokens=0), "max_tokens must be at least 1"),
])
def test_bad_opens_are_invalid_argument(fields, needle):
    with pytest.raises(SledError) as err:
        open_from_pb(pb.Open(**{"max_tokens": 1, **fields}), 1000 if "stop_token_ids" in fields and len(
            fields["stop_token_ids"]) > 1 else 100, CONFIG)
    assert err.value.code == "INVALID_ARGUMENT" and needle in err.value.message


@pytest.mark.parametrize("temperature,greedy", [(0.0, True), (1e-40, True), (1e-6, True), (2**-17 * 0.9999999, True),
                                                (2**-17, False), (1e-5, False), (0.7, False)])
def test_a_temperature_below_the_floor_is_greedy_on_both_sides(temperature, greedy):
    from edge_client.sampling import SamplingParams as DeviceSampling

    request = open_from_pb(pb.Open(context_token_ids=[1], max_tokens=1,
                                   sampling=pb.SamplingParams(temperature=temperature)), 100, CONFIG)
    assert request.sampling.greedy == greedy
    assert DeviceSampling(temperature=temperature).greedy == greedy


def test_a_rule_is_asked_per_session_with_the_server_s_parameters_and_its_limits():
    def rule(config=CONFIG, temperature=0.0, **fields):
        msg = pb.Open(context_token_ids=[1], max_tokens=1, sampling=pb.SamplingParams(temperature=temperature),
                      **fields)
        return open_from_pb(msg, 100, config).rule

    assert rule().name == "exact" and rule(verification=pb.VERIFICATION_EXACT).name == "exact"
    got = rule(verification=pb.VERIFICATION_FLY)
    assert (got.window, got.entropy_threshold) == (6, pytest.approx(0.3))  # the rule's defaults
    got = rule(verification=pb.VERIFICATION_FLY, verification_params={"window": 3, "entropy_threshold": 0.5})
    assert (got.window, got.entropy_threshold) == (3, pytest.approx(0.5))
    tuned = ServerConfig(max_seq_len=64, verification_params=["fly:window=4"])
    assert rule(tuned, verification=pb.VERIFICATION_FLY).window == 4  # the server's parameters
    assert rule(tuned, verification=pb.VERIFICATION_FLY, verification_params={"window": 2}).window == 2
    fly_server = ServerConfig(max_seq_len=64, verification="fly:window=5")
    assert rule(fly_server).window == 5  # the server's default rule, with its parameters
    assert rule(fly_server, temperature=0.7).name == "exact"  # ... which leaves sampled sessions exact
    for fields, config, code, needle in (
            (dict(temperature=0.7), CONFIG, "INVALID_ARGUMENT",
             "fly verification applies to greedy generation (temperature 0) only: sampling is verified exactly"),
            (dict(), ServerConfig(max_seq_len=64, refuse_verification=["fly"]), "FAILED_PRECONDITION",
             "does not allow fly verification (refuse_verification)"),
            (dict(verification_params={"window": 16}), CONFIG, "INVALID_ARGUMENT",
             "fly verification needs drafts of 17 tokens, over this server's max_draft_tokens 16"),
            (dict(verification_params={"window": 2.5}), CONFIG, "INVALID_ARGUMENT",
             "fly's window must be an integer in [1, 64), got 2.5"),
            (dict(verification_params={"colour": 1}), CONFIG, "INVALID_ARGUMENT",
             "fly verification has no parameter 'colour' (its parameters: window, entropy_threshold)")):
        with pytest.raises(SledError) as err:
            rule(config, verification=pb.VERIFICATION_FLY, **fields)
        assert err.value.code == code and needle in err.value.message, err.value.message
    with pytest.raises(SledError, match="verification 7 is not one this server knows"):
        rule(verification=7)


class FakeGrammars:
    """Compiles nothing: records what an Open's constraint asked of the server's grammars."""

    def __init__(self):
        self.asked = []

    def matcher(self, constraint, generated=()):
        self.asked.append((constraint, list(generated)))
        return "matcher"


def test_a_constrained_open_is_verified_exactly_and_resumes_after_the_tokens_generated_under_it():
    def opened(config=CONFIG, **constraint):
        grammars = FakeGrammars()
        msg = pb.Open(context_token_ids=[1, 2, 3, 4], max_tokens=1, constraint=pb.Constraint(**constraint))
        return open_from_pb(msg, 100, config, grammars=grammars), grammars.asked

    request, asked = opened(regex="[0-9]+", generated_tokens=2)
    assert request.matcher == "matcher" and asked[0][0].kind == "regex" and asked[0][1] == [3, 4]
    request, asked = opened(json_object=True)
    assert asked[0][0].kind == "json_object" and asked[0][1] == []
    # a server whose default rule is loose verifies a constrained session exactly
    request, _ = opened(ServerConfig(max_seq_len=64, verification="fly"), regex="a")
    assert request.rule.name == "exact"
    for msg, needle in (
            (pb.Open(context_token_ids=[1], max_tokens=1, constraint=pb.Constraint()), "constraint has no kind"),
            (pb.Open(context_token_ids=[1, 2], max_tokens=1, constraint=pb.Constraint(regex="a", generated_tokens=2)),
             "constraint.generated_tokens 2: the context has 2 tokens"),
            (pb.Open(context_token_ids=[1], max_tokens=1, constraint=pb.Constraint(json_schema="{nope")),
             "constraint: json_schema is not JSON"),
            (pb.Open(context_token_ids=[1], max_tokens=1, constraint=pb.Constraint(regex="a" * 70000)),
             "over the limit"),
            (pb.Open(context_token_ids=[1], max_tokens=1, verification=pb.VERIFICATION_FLY,
                     constraint=pb.Constraint(regex="a")), "fly verification cannot take a constraint")):
        with pytest.raises(SledError) as err:
            open_from_pb(msg, 100, CONFIG, grammars=FakeGrammars())
        assert err.value.code == "INVALID_ARGUMENT" and needle in err.value.message, err.value.message
