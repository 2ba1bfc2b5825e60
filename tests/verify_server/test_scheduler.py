from verify_server.config import ServerConfig
from verify_server.scheduler import Scheduler, VerifyWork
from verify_server.sessions import DraftRequest, SamplingParams, Session


def session(i, tokens=3, kv_len=2):
    return Session(id=f"s{i}", slot=i, tokens=list(range(tokens)), sampling=SamplingParams(), remaining=10,
                   stop_ids=frozenset(), generator=None, kv_len=kv_len)


def work(s, k, t=0.0):
    return VerifyWork(s, DraftRequest(0, tuple(range(k)), None, None), reply=None, enqueued=t)


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
