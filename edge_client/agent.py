"""The device agent's core: one gRPC channel, a pool of drafters, one session per local request."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable

from sled.constraints import Constraint

from .config import EdgeConfig
from .drafters import create_drafter
from .generation import generate
from .request import Callbacks, Request
from .policy import DraftLength
from .result import GenerationResult
from .sampling import SamplingParams
from .tokenizer import Tokenizer
from .servers import connect

log = logging.getLogger(__name__)


@dataclass
class Completion:
    result: GenerationResult
    text: str  # cut at a stop string if one was hit
    finish_reason: str


class StopTexts:
    """Holds back just enough text to cut at a stop string that arrives split across pieces."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.hit = False

    def feed(self, piece: str) -> str:
        if self.hit:
            return ""
        self.text += piece
        for stop in self.stops:
            at = self.text.find(stop)
            if at >= 0:
                self.hit = True
                self.text = self.text[:at]
                out, self.sent = self.text[self.sent:], len(self.text)
                return out
        upto = max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:upto], upto
        return out

    def flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


class AgentBusy(Exception):
    """Every slot is generating and max_queued requests already wait for one."""


class Agent:
    def __init__(self, config: EdgeConfig):
        self.config = config
        self.tokenizer = Tokenizer(config.tokenizer or config.draft_model)
        self.client = connect(config.server, config.token(), config.channel_tls())
        self.policy, self.resilience = config.draft_policy(), config.resilience()
        self._options = config.drafter_options()
        # Idle (drafter, draft-length controller) pairs: a controller stays with its drafter across requests, as
        # what it measures (acceptance, drafting time, round trip) is that drafter's and the server's.
        self._idle: asyncio.Queue = asyncio.Queue()
        # Made now so a bad drafter setting fails at start; it then serves the first request.
        self._idle.put_nowait((create_drafter(config.drafter, self._options), self._controller()))
        self._made = 1
        self._slots = asyncio.Semaphore(config.max_concurrent)
        self.active = 0
        self.waiting = 0  # requests waiting for a slot
        self.served = 0
        self._server_context: int | None = None  # the verify server's context limit, once asked

    def _controller(self) -> DraftLength:
        return self.policy.controller()

    async def _drafter(self) -> tuple:
        if self._idle.empty() and self._made < self.config.max_concurrent:
            self._made += 1
            return await asyncio.to_thread(create_drafter, self.config.drafter, self._options), self._controller()
        return await self._idle.get()

    def busy(self) -> str | None:
        """Why a new request would be turned away now (every slot generating, max_queued waiting), or None."""
        if not (self._slots.locked() and self.waiting >= self.config.max_queued):
            return None
        return (f"the device agent is busy: {self.active} requests generating (max_concurrent "
                f"{self.config.max_concurrent}) and {self.waiting} waiting (max_queued {self.config.max_queued}); "
                "retry later")

    def request(self, prompt_ids: list[int], sampling: SamplingParams, max_tokens: int,
                constraint: Constraint | None = None) -> Request:
        """A request as this device serves it (its draft policy, its name); ValueError where it cannot be."""
        return Request(prompt_ids, max_tokens, sampling, self.policy, client_id=f"sled-agent/{self.config.drafter}",
                       constraint=constraint)

    async def complete(self, asked: Request, stops: list[str], on_text: Callable[[str, bool], None] | None = None,
                       gone: Callable[[], bool] | None = None) -> Completion:
        """One request's generation, cut at the `stops` texts. `gone`: whether the app that asked has gone away (its
        connection closed): checked every round, it ends the generation there (finish reason stop), its session
        closed."""
        self._check_device_fits(len(asked.prompt_token_ids), asked.max_tokens)
        stop = StopTexts(stops)

        def piece(text: str, verified: bool) -> None:
            out = stop.feed(text)
            if out and on_text is not None:
                on_text(out, verified)

        busy = self.busy()
        if busy:
            raise AgentBusy(busy)
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        try:
            drafter, controller = await self._drafter()
            self.active += 1
            try:
                heard = Callbacks(on_text=piece, on_status=log.warning,
                                  should_stop=lambda: stop.hit or (gone is not None and gone()))
                result = await generate(self.client, drafter, self.tokenizer, asked, resilience=self.resilience,
                                        controller=controller, callbacks=heard)
            finally:
                self.active -= 1
                self.served += 1
                self._idle.put_nowait((drafter, controller))
        finally:
            self._slots.release()
        tail = stop.flush()
        if tail and on_text is not None:
            on_text(tail, True)
        return Completion(result, stop.text, "stop" if stop.hit else (result.finish_reason or "stop"))

    def _check_device_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        if prompt_tokens + max_tokens > self.config.context_size:
            raise ValueError(f"prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds the "
                             f"device context of {self.config.context_size} tokens")

    async def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        """ValueError where the prompt cannot be served: past the device's context, or a prompt the server's
        context cannot hold (its limit asked once, where the server answers)."""
        self._check_device_fits(prompt_tokens, max_tokens)
        if self._server_context is None:
            try:
                self._server_context = (await asyncio.wait_for(self.client.info(timeout=1.5), 3.0)).context_limit
            except Exception:  # noqa: BLE001 - unknown for now: the server's own refusal then says it
                return
        if prompt_tokens >= self._server_context:
            raise ValueError(f"prompt of {prompt_tokens} tokens is over the verify server's context of "
                             f"{self._server_context} tokens")

    async def server_reachable(self) -> bool:
        try:
            await asyncio.wait_for(self.client.info(timeout=1.5), 3.0)  # info may try once more, up to 1 s
            return True
        except Exception:  # noqa: BLE001 - health reports, never raises
            return False

    async def close(self) -> None:
        await self.client.close()
        while not self._idle.empty():
            self._idle.get_nowait()[0].close()
