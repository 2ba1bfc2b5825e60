"""The one way every benchmark runs devices against a verify server from this process, and sums what they did.

A device here is the device's own generation loop (edge_client.generation.generate) with a drafter of this
process; `Runner` holds the connection, `Run` what a batch of generations gave, `summary` their figures.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from edge_client.adaptive import AdaptiveDraftLength
from edge_client.generation import generate
from edge_client.policy import DraftPolicy
from edge_client.request import Callbacks, Request
from edge_client.resilience import Resilience
from edge_client.transport import VerifierClient
from edge_client.workload import QUESTIONS


def chat(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text as a user's turn in the chat template, encoded: a device's prompts."""
    return [tokenizer.encode(tokenizer.chat_prompt([{"role": "user", "content": t}])) for t in texts]


def prompts(tokenizer, n: int) -> list[list[int]]:
    """n chat prompts of the device workload's questions, in turn."""
    return chat(tokenizer, [QUESTIONS[i % len(QUESTIONS)] for i in range(n)])


def summary(results) -> dict:
    """What every benchmark reports of devices' generations (GenerationResult): figures() of their sums."""
    return figures(tokens=sum(len(r.token_ids) for r in results), drafted=sum(r.draft_tokens for r in results),
                   accepted=sum(r.accepted_tokens for r in results),
                   loosely_accepted=sum(r.loosely_accepted_tokens for r in results),
                   rounds=sum(r.rounds for r in results), elapsed_s=sum(r.elapsed_s for r in results))


def figures(tokens: int, drafted: int, accepted: int, loosely_accepted: int, rounds: int, elapsed_s: float) -> dict:
    """Generations' summed counts with their rates: acceptance rate, mean acceptance length (vLLM's: 1 + accepted /
    rounds), draft tokens a round, and tokens a second of generating (their tokens over their summed time)."""
    return {"tokens": tokens, "drafted": drafted, "accepted": accepted, "loosely_accepted": loosely_accepted,
            "rounds": rounds, "elapsed_s": elapsed_s, "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_acceptance_length": 1 + accepted / rounds if rounds else 0.0,
            "draft_tokens_per_round": drafted / rounds if rounds else 0.0,
            "tokens_per_s": tokens / elapsed_s if elapsed_s > 0 else 0.0}


@dataclass
class Job:
    """One generation to run: the device's drafter, the request, and what hears it as it goes."""
    drafter: object
    request: Request
    callbacks: Callbacks = field(default_factory=Callbacks)


@dataclass
class Run:
    """Generations run together or in turn: their results in the order asked, the wall time, and the server's
    statistics (ServerStats) before and after."""
    results: list
    wall_s: float
    before: object
    after: object

    def summary(self) -> dict:
        """summary() of the results, with all their tokens over the wall time and the server's steps over the run."""
        steps = self.after.steps - self.before.steps
        verifications = self.after.verifications - self.before.verifications
        s = summary(self.results)
        return s | {"wall_s": self.wall_s, "system_tokens_per_s": s["tokens"] / self.wall_s if self.wall_s else 0.0,
                    "server_steps": steps, "mean_batch_sessions": verifications / steps if steps else 0.0}


class Runner:
    """Devices of this process against the server at `address`: on one shared connection, or with
    `own_connection` on a TCP connection of the runner's own, as a separate device has. Use with `async with`."""

    def __init__(self, address: str, tokenizer, own_connection: bool = False, resilience: Resilience = Resilience()):
        self.client = VerifierClient(address, own_connection=own_connection)
        self.tokenizer, self.resilience = tokenizer, resilience

    async def __aenter__(self) -> Runner:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self, drain_timeout: float | None = None) -> None:
        """Close the connection once the sessions closed on it have ended (at most drain_timeout s, or the
        client's default)."""
        await (self.client.close() if drain_timeout is None else self.client.close(drain_timeout))

    async def generate(self, job: Job, controller=None):
        """One generation; `controller` is the device's adaptive controller, kept across its requests."""
        return await generate(self.client, job.drafter, self.tokenizer, job.request, resilience=self.resilience,
                              controller=controller, callbacks=job.callbacks)

    async def stats(self):
        """The server's statistics now (ServerStats)."""
        return (await self.client.info()).stats

    async def run(self, jobs: list[Job], together: bool = True) -> Run:
        """The jobs at once (each its own device) or one after another (one device), timed, between two reads of the
        server's statistics."""
        before = await self.stats()
        start = time.perf_counter()
        if together:
            results = list(await asyncio.gather(*[self.generate(job) for job in jobs]))
        else:  # one device, which keeps its adaptive controller across its requests
            kept = device_controller(jobs[0].request.policy) if jobs else None
            results = [await self.generate(job, kept) for job in jobs]
        wall = time.perf_counter() - start
        return Run(results, wall, before, await self.stats())


def device_controller(policy: DraftPolicy) -> AdaptiveDraftLength | None:
    """The adaptive controller a device keeps across its requests (as the agent does), None for a fixed K."""
    controller = policy.controller()
    return controller if isinstance(controller, AdaptiveDraftLength) else None


def run(address: str, tokenizer, jobs: list[Job], together: bool = True) -> Run:
    """Runner.run from synchronous code, on a connection of its own."""
    async def main() -> Run:
        async with Runner(address, tokenizer) as runner:
            return await runner.run(jobs, together)

    return asyncio.run(main())
