from verify_server.config import ServerConfig
from verify_server.scheduler import Scheduler, VerifyWork
from verify_server.sessions import DraftRequest, SamplingParams, Session


def session(i, tokens=3, kv_len=2):
    return Session(id=f"s{i}", slot=i, tokens=list(range(tokens)), sampling=SamplingParams(), remaining=10,
                   stop_ids=frozenset(), generator=None, kv_len=kv_len)


def work(s, k, t=0.0):
    return VerifyWork(s, DraftRequest(0, tuple(range(k))), reply=None, enqueued=t)


def test_plan_respects_session_and_token_limits_and_shares_with_prefill():
    sched = Scheduler(ServerConfig(max_batch_sessions=2, max_batch_tokens=20, max_draft_tokens=4))
    pending = [work(session(i), 4) for i in range(3)]
    newcomer = session(9, tokens=50, kv_len=0)
    plan = sched.plan(pending, [newcomer])
    assert [w.session.id for w in plan.verifies] == ["s0", "s1"]
    assert [(p.session.id, p.length) for p in plan.prefills] == [("s9", 10)]
    assert plan.num_tokens == 20


def test_unprefilled_sessions_wait():
    sched = Scheduler(ServerConfig())
    cold = session(1, tokens=30, kv_len=4)
    plan = sched.plan([work(cold, 2)], [cold])
    assert not plan.verifies and plan.prefills[0].length == 25


def test_ready_when_full_when_alone_or_after_max_wait():
    sched = Scheduler(ServerConfig(max_batch_sessions=2, max_wait_ms=10))
    a, b = session(0), session(1)
    assert sched.ready([work(a, 2, 0.0)], [], open_sessions=1, oldest=0.0, now=0.0)  # nobody else to wait for
    assert not sched.ready([work(a, 2, 0.0)], [], open_sessions=3, oldest=0.0, now=0.005)
    assert sched.ready([work(a, 2, 0.0)], [], open_sessions=3, oldest=0.0, now=0.011)
    assert sched.ready([work(a, 2), work(b, 2)], [], open_sessions=3, oldest=0.0, now=0.0)
    assert not sched.ready([], [], open_sessions=3, oldest=None, now=1.0)


def test_prompts_are_prefilled_in_chunks_while_others_decode():
    sched = Scheduler(ServerConfig(max_batch_tokens=512))
    heavy = session(1, tokens=2000, kv_len=0)
    light = session(2)
    plan = sched.plan([work(light, 4)], [heavy], chunk=64)
    assert [w.session.id for w in plan.verifies] == ["s2"]
    assert [(p.session.id, p.length) for p in plan.prefills] == [("s1", 64)]
    # with nobody decoding, nobody waits behind the prompt: the whole budget goes to it
    plan = sched.plan([], [heavy], chunk=None)
    assert [(p.session.id, p.length) for p in plan.prefills] == [("s1", 512)]


def test_the_shortest_remaining_prompt_is_prefilled_first():
    sched = Scheduler(ServerConfig(max_batch_tokens=512))
    heavy = [session(i, tokens=2000, kv_len=0) for i in range(4)]
    newcomer = session(9, tokens=41, kv_len=0)
    plan = sched.plan([], heavy + [newcomer], chunk=64)
    assert [(p.session.id, p.length) for p in plan.prefills] == [("s9", 40), ("s0", 24)]


def test_the_cost_model_fits_fixed_and_per_token_cost_and_sizes_chunks():
    from verify_server.cost_model import StepCostModel

    costs = StepCostModel()
    assert costs.tokens_costing(10.0, 512) == 512  # nothing measured: tokens seem free
    for tokens in (1, 8, 16, 64, 1, 32):
        costs.record(tokens, (20.0 + 2.5 * tokens) / 1000)  # a CPU: 20 ms a step, 2.5 ms a token
    assert abs(costs.fixed_ms - 20.0) < 1e-6 and abs(costs.token_ms - 2.5) < 1e-6
    assert costs.tokens_costing(costs.fixed_ms / 2, 512) == 4
    gpu = StepCostModel()
    for tokens in (1, 8, 16, 64, 1, 32):
        gpu.record(tokens, (10.0 + 0.02 * tokens) / 1000)  # launch-bound: tokens are nearly free
    assert gpu.tokens_costing(gpu.fixed_ms / 2, 512) in (249, 250)  # 5 ms / 0.02 ms, to rounding
