from verify_server.config import ServerConfig
from verify_server.scheduler import PREFILL_PATIENCE_S, Scheduler, VerifyWork
from verify_server.sessions import DraftRequest, SamplingParams, Session


def session(i, tokens=3, kv_len=2):
    return Session(id=f"s{i}", blocks=[], tokens=list(range(tokens)), sampling=SamplingParams(), remaining=10,
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


def test_a_long_prompt_is_not_starved_by_shorter_ones_that_keep_coming():
    """A fleet under load opens a short prompt every step, each the whole chunk: shortest first alone would prefill
    every newcomer and never the long prompt (as long as newcomers come). Once it has waited PREFILL_PATIENCE_S it
    goes first, and is prefilled while newcomers still come; they wait their turn, oldest first, not for ever."""
    sched = Scheduler(ServerConfig(max_batch_tokens=512))
    step_s, chunk = 0.1, 64
    long_prompt = session(0, tokens=401, kv_len=0)
    long_prompt.opened_at = 0.0
    prefilling, done_at, opened = [long_prompt], {}, {}
    for i in range(1, 200):
        now = i * step_s
        newcomer = session(i, tokens=65, kv_len=0)  # a whole chunk
        newcomer.opened_at = opened[newcomer.id] = now
        prefilling.append(newcomer)
        for p in sched.plan([], prefilling, chunk=chunk, now=now).prefills:
            p.session.kv_len += p.length
        for s in [s for s in prefilling if s.prefilled]:
            prefilling.remove(s)
            done_at[s.id] = now
        if "s0" in done_at:
            break
    assert "s0" in done_at and done_at["s0"] <= PREFILL_PATIENCE_S + 10 * step_s
    # each newcomer prefilled so far waited at most the long prompt's turn and its own patience
    assert max(done_at[k] - opened[k] for k in done_at if k != "s0") <= PREFILL_PATIENCE_S + 10 * step_s
    # within its patience, shortest first: the newcomer before the long prompt
    fresh, newcomer = session(0, tokens=401, kv_len=0), session(1, tokens=41, kv_len=0)
    fresh.opened_at = newcomer.opened_at = 5.0
    plan = sched.plan([], [fresh, newcomer], chunk=chunk, now=5.0 + PREFILL_PATIENCE_S / 2)
    assert [(p.session.id, p.length) for p in plan.prefills] == [("s1", 40), ("s0", 24)]


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


def fitted(fixed_ms=20.0, token_ms=2.5):
    from verify_server.cost_model import StepCostModel

    costs = StepCostModel()
    for tokens in (1, 8, 16, 64, 1, 32):
        costs.record(tokens, (fixed_ms + token_ms * tokens) / 1000)
    return costs


def answered(i, at, gap=None):
    """A prefilled session last answered at `at` (the test's clock), its usual draft gap `gap`."""
    s = session(i)
    s.answered_at, s.draft_gap_s = at, gap
    return s


def test_idle_sessions_do_not_shrink_a_prompt_chunk():
    sched = Scheduler(ServerConfig(max_batch_tokens=512))
    costs = fitted()
    prompt = session(9, tokens=1000, kv_len=0)
    never_drafted = answered(1, at=0.0)  # opened and prefilled, then silent
    went_quiet = answered(2, at=0.0, gap=0.05)  # drafted every 50 ms, then stopped
    assert sched.prefill_chunk([], [prompt, never_drafted, went_quiet], now=10.0, costs=costs) is None
    assert sched.next_draft([], [never_drafted, went_quiet], now=10.0) is None
    assert sched.hold([], [prompt, never_drafted, went_quiet], now=10.0) == 0.0


def test_waiting_drafts_shrink_the_chunk_to_the_step_target():
    costs = fitted()  # 20 ms a step, 2.5 ms a token
    prompt = session(9, tokens=1000, kv_len=0)
    light = answered(1, at=0.0)
    pending = [work(light, 4)]
    # the default target is two fixed costs: 40 ms, 20 ms of tokens, 8 of them; the draft takes 5
    assert Scheduler(ServerConfig(prefill_min_tokens=1)).prefill_chunk(pending, [prompt, light], now=10.0,
                                                                       costs=costs) == 3
    sched = Scheduler(ServerConfig(step_target_ms=120.0, prefill_min_tokens=4))
    assert sched.prefill_chunk(pending, [prompt, light], now=10.0, costs=costs) == 40 - 5
    fixed = Scheduler(ServerConfig(prefill_chunk_tokens=24))
    assert fixed.prefill_chunk(pending, [prompt, light], now=10.0, costs=costs) == 24
    assert fixed.prefill_chunk([], [prompt], now=10.0, costs=costs) is None  # nobody waits: no cap at all


def test_a_draft_due_within_the_step_shrinks_the_chunk_and_one_due_later_lends_it_the_time_until_then():
    sched = Scheduler(ServerConfig(step_target_ms=60.0, prefill_min_tokens=4, max_batch_tokens=512))
    costs = fitted()  # a whole-budget step: 20 + 2.5 * 512 = 1300 ms
    prompt = session(9, tokens=2000, kv_len=0)
    soon = answered(1, at=9.995, gap=0.010)  # due at 10.005
    assert sched.prefill_chunk([], [prompt, soon], now=10.0, costs=costs) == 16  # (60 - 20) / 2.5
    later = answered(2, at=10.0, gap=0.400)  # due in 400 ms: a chunk that ends by then
    assert sched.prefill_chunk([], [prompt, later], now=10.0, costs=costs) == (400 - 20) // 2.5
    beyond = answered(3, at=10.0, gap=2.0)  # due after a whole-budget step would end
    assert sched.prefill_chunk([], [prompt, beyond], now=10.0, costs=costs) is None


def test_the_chunk_never_falls_below_its_floor():
    costs = fitted(fixed_ms=20.0, token_ms=2.5)
    prompt = session(9, tokens=1000, kv_len=0)
    lights = [answered(i, at=0.0) for i in range(12)]
    pending = [work(s, 8) for s in lights]  # 108 tokens of drafts: past the 60 ms target on their own
    assert Scheduler(ServerConfig()).prefill_chunk(pending, [prompt, *lights], now=0.0, costs=costs) == 16
    slow = fitted(fixed_ms=20.0, token_ms=500.0)  # every token past the target
    assert Scheduler(ServerConfig(prefill_min_tokens=3)).prefill_chunk(pending, lights, now=0.0, costs=slow) == 3


def test_a_prefill_step_holds_for_a_draft_due_within_the_batching_window():
    sched = Scheduler(ServerConfig(max_wait_ms=5.0))
    light = answered(1, at=10.0, gap=0.002)  # due at 10.002
    assert abs(sched.hold([], [light], now=10.0) - 0.007) < 1e-9  # until 5 ms past its due time
    assert sched.hold([], [light], now=10.008) == 0.0  # late past the window: the step goes without it
    assert sched.hold([work(light, 2)], [light], now=10.0) == 0.0  # a draft waits: nothing to hold for
    far = answered(2, at=10.0, gap=0.050)
    assert sched.hold([], [far], now=10.0) == 0.0  # not within the window


def test_a_sessions_draft_gap_follows_its_rounds():
    s = answered(1, at=1.0)
    s.draft_arrived(1.04)
    assert abs(s.draft_gap_s - 0.04) < 1e-12
    s.answered_at = 2.0
    s.draft_arrived(2.08)
    assert abs(s.draft_gap_s - (0.75 * 0.04 + 0.25 * 0.08)) < 1e-12
    fresh = session(2)
    fresh.draft_arrived(5.0)  # never answered: no gap to learn from
    assert fresh.draft_gap_s is None
