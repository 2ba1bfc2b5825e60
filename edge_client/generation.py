"""The device-side round loop: draft, send, commit the verdict, roll the drafter back, repeat."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable

from . import codec
from .drafters.base import Drafter, Proposal
from .sampling import SamplingParams
from .tokenizer import Tokenizer
from .transport import VerifierClient


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    elapsed_s: float = 0.0
    finish_reason: str | None = None
    drafter: str = ""

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        # vLLM: 1 + accepted / drafts, one draft per round.
        return 1.0 + self.accepted_tokens / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def stats(self) -> dict:
        return {
            "prompt_token_ids": self.prompt_token_ids,
            "token_ids": self.token_ids,
            "text": self.text,
            "drafter": self.drafter,
            "finish_reason": self.finish_reason,
            "rounds": self.rounds,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "elapsed_s": self.elapsed_s,
            "tokens_per_second": self.tokens_per_second,
        }


async def generate(
    client: VerifierClient,
    drafter: Drafter,
    tokenizer: Tokenizer,
    prompt_token_ids: list[int],
    *,
    max_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    draft_tokens: int = 4,
    stop_token_ids: list[int] = (),
    on_text: Callable[[str], None] | None = None,
    client_id: str = "",
) -> GenerationResult:
    if not prompt_token_ids:
        raise ValueError("the prompt is empty: nothing to continue")
    if max_tokens <= 0:
        raise ValueError("max_tokens must be at least 1")
    result = GenerationResult(prompt_token_ids=list(prompt_token_ids), drafter=getattr(drafter, "name", ""))
    start = time.perf_counter()
    open_msg = codec.open_message(list(prompt_token_ids), sampling, max_tokens, tokenizer.fingerprint,
                                  stop_token_ids, client_id, client.auth_token or "")
    session = await client.open(open_msg)
    k = min(draft_tokens, session.opened.max_draft_tokens)
    context = list(prompt_token_ids)
    decoder = tokenizer.stream_decoder()
    pieces: list[str] = []
    try:
        await asyncio.to_thread(drafter.begin, context, sampling)
        while True:
            proposal = await asyncio.to_thread(drafter.propose, context, k) if k > 0 else Proposal([])
            verdict = await session.verify(result.rounds, proposal)
            committed = proposal.token_ids[: verdict.n_accepted]
            if verdict.next_token is not None:
                committed = committed + [verdict.next_token]
            context.extend(committed)
            drafter.accept(context)
            result.token_ids.extend(committed)
            result.rounds += 1
            result.draft_tokens += len(proposal.token_ids)
            result.accepted_tokens += verdict.n_accepted
            piece = decoder.feed(committed)
            pieces.append(piece)
            if on_text is not None and piece:
                on_text(piece)
            if verdict.finished:
                result.finish_reason = verdict.finish_reason
                break
        await session.close()
    except BaseException:
        session.cancel()
        raise
    tail = decoder.flush()
    if tail and on_text is not None:
        on_text(tail)
    result.text = "".join(pieces) + tail
    result.elapsed_s = time.perf_counter() - start
    return result
