"""The one runner and the one summary every benchmark gives of devices' generations."""

import asyncio
from types import SimpleNamespace

from bench import runner
from bench.runner import Job, Run, Runner, figures, summary
from edge_client.request import Request
from edge_client.result import GenerationResult


def test_a_device_summary_counts_tokens_rounds_and_acceptance_over_all_its_generations():
    one = GenerationResult([1], [2, 3, 4], rounds=2, draft_tokens=6, accepted_tokens=3, loosely_accepted_tokens=1,
                           elapsed_s=0.5)
    two = GenerationResult([1], [5], rounds=1, draft_tokens=2, accepted_tokens=0, elapsed_s=0.25)
    s = summary([one, two])
    assert (s["tokens"], s["drafted"], s["accepted"], s["loosely_accepted"], s["rounds"]) == (4, 8, 3, 1, 3)
    assert s["acceptance_rate"] == 3 / 8
    assert s["mean_acceptance_length"] == 1 + 3 / 3  # vLLM's: 1 + accepted / rounds
    assert s["draft_tokens_per_round"] == 8 / 3
    assert s["tokens_per_s"] == 4 / 0.75  # tokens over the generations' summed time
    assert summary([])["mean_acceptance_length"] == 0.0
    # the same figures from counts summed elsewhere (a benchmark's JSON rows)
    assert figures(tokens=4, drafted=8, accepted=3, loosely_accepted=1, rounds=3, elapsed_s=0.75) == s


def test_a_run_adds_the_wall_time_and_the_servers_steps_to_the_summary():
    before = SimpleNamespace(steps=10, verifications=12)
    after = SimpleNamespace(steps=14, verifications=24)
    s = Run([GenerationResult([1], [2, 3, 4, 5], rounds=2, elapsed_s=1.0)], 2.0, before, after).summary()
    assert s["system_tokens_per_s"] == 4 / 2.0 and s["tokens_per_s"] == 4.0
    assert (s["server_steps"], s["mean_batch_sessions"]) == (4, 12 / 4)


class FakeClient:
    """A verify server's client as the runner uses it: statistics that count the generations run."""

    def __init__(self):
        self.steps, self.closed = 0, False

    async def info(self):
        return SimpleNamespace(stats=SimpleNamespace(steps=self.steps, verifications=self.steps))

    async def close(self, *args):
        self.closed = True


def test_the_runner_runs_jobs_together_or_in_turn_between_two_reads_of_the_servers_statistics(monkeypatch):
    order = []

    async def generate(client, drafter, tokenizer, request, *, resilience, controller, callbacks):
        order.append(("start", drafter))
        await asyncio.sleep(0)  # together, every job starts before any ends
        order.append(("end", drafter))
        client.steps += 1
        return GenerationResult(request.prompt_token_ids, [7] * request.max_tokens)

    monkeypatch.setattr(runner, "generate", generate)
    monkeypatch.setattr(runner, "VerifierClient", lambda *a, **k: FakeClient())
    jobs = [Job("a", Request([1], max_tokens=2)), Job("b", Request([1], max_tokens=3))]

    async def main(together):
        async with Runner("addr", tokenizer=None) as r:
            done = await r.run(jobs, together)
        assert r.client.closed
        return done

    done = asyncio.run(main(True))
    assert [len(x.token_ids) for x in done.results] == [2, 3]  # in the order asked
    assert order[:2] == [("start", "a"), ("start", "b")]
    assert (done.before.steps, done.after.steps) == (0, 2)
    order.clear()
    asyncio.run(main(False))
    assert order == [("start", "a"), ("end", "a"), ("start", "b"), ("end", "b")]
