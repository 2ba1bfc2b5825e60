"""Replayed devices: what a real drafter proposes along the target's greedy text, recorded once and replayed at the
drafter's measured speed (or synthesized at a given match rate for a random target), so that a benchmark measures the
server apart from drafting on the same cores."""

from __future__ import annotations

import threading
import time

import numpy as np

from edge_client.drafters import DrafterOptions, create_drafter
from edge_client.drafters.base import Proposal
from edge_client.drafters.kv_drafter import common_prefix
from edge_client.request import Request
from edge_client.sampling import SamplingParams

from .runner import Job, run


class DraftClock:
    """The drafting time replayed drafters asked for and took (wall time, the wait to resume after each sleep
    included), over every drafter that shares it: what drafting speed the benchmark's devices reached."""

    def __init__(self):
        self._lock = threading.Lock()
        self.asked = self.took = 0.0
        self.tokens = 0
        # the prompts' prefill, apart from the tokens: what it asked (and was charged), over how many requests
        self.prefill_asked = 0.0
        self.prefills = 0

    def add(self, asked: float, took: float, tokens: int) -> None:
        with self._lock:
            self.asked, self.took, self.tokens = self.asked + asked, self.took + took, self.tokens + tokens

    def add_prefill(self, asked: float) -> None:
        with self._lock:
            self.prefill_asked += asked
            self.prefills += 1

    def ms_per_token(self) -> float:
        """The tokens' drafting time a token. Every overrun counts here (the prefill is charged only what it asked),
        and an overrun carried to a later sleep only pays itself back, so this is never under the rate asked."""
        return self.took / self.tokens * 1000 if self.tokens else float("nan")

    def prefill_share(self) -> float:
        """The share of the drafters' time spent prefilling prompts; nan before any drafting."""
        total = self.took + self.prefill_asked
        return self.prefill_asked / total if total else float("nan")


class ReplayDrafter:
    """Proposes what a real drafter proposed at the same context, after its measured drafting time.

    A context off the recorded output (a drafted token the target rejects came before) gets filler tokens,
    after the same time: a real drafter's tokens there are never accepted either, since verification stops
    at the first rejected token, so only the time they take matters. With the drafter's recorded confidence in
    each token, the adaptive controller's stop rule ends a draft where the real drafter would have."""

    name = "replay"

    def __init__(self, rounds: dict[int, list[int]], seconds_per_token: float, full: list[int] | None = None,
                 confidence: dict[int, list[float]] | None = None, clock: DraftClock | None = None,
                 prefill_s: float = 0.0):
        self.rounds, self.spt, self.prefixes, self.confidence = rounds, seconds_per_token, full, confidence
        self.clock = clock
        self.owed = 0.0  # what earlier sleeps overran, taken off the next ones
        # The prompt's prefill, spent before the first token: a real drafter feeds the prompt's tokens past what its
        # KV cache kept from the device's last request (the shared system prompt) at its first propose.
        self.prefill_s = prefill_s

    def begin(self, context, sampling):
        pass

    def propose(self, context, k, stop=None):
        tokens, sure = self.rounds.get(len(context)), None
        if tokens is None or (self.prefixes is not None and list(context) != self.prefixes[:len(context)]):
            tokens = [
                context[-1] ^ 1
            ] * k  # off the recording: filler, never the last token (a random target repeats it)
        elif self.confidence is not None:
            sure = self.confidence[len(context)]
        tokens = tokens[:k]
        drafted = len(tokens)
        if sure is not None and stop is not None:
            n = drafted = 0
            while n < len(tokens):
                drafted += 1  # a token is drafted before its confidence is known
                if not stop.take(sure[n]):
                    break
                n += 1
                if not stop.more():
                    break
            tokens = tokens[:n]
        self._spend(drafted)
        return Proposal(list(tokens), confidence=None if sure is None else list(sure[:len(tokens)]))

    def _spend(self, drafted: int) -> None:
        """Sleep the drafting time of `drafted` tokens, less what this drafter's earlier sleeps overran. The
        benchmark runs every device in one process, and a sleep ends only when its thread has the GIL back, so with
        many devices the sleeps overrun, which a real device, drafting on its own cores, does not. Carried over, the
        overrun leaves the average at the rate asked while it stays under a token's time (reports give the rate
        reached)."""
        prefill, self.prefill_s = self.prefill_s, 0.0  # the prompt's, before the first token only
        asked = self.spt * drafted + prefill
        t0 = time.perf_counter()
        if asked - self.owed > 0:
            time.sleep(asked - self.owed)
        took = time.perf_counter() - t0
        self.owed = max(0.0, self.owed + took - asked)
        if self.clock is not None:
            if prefill:
                # One sleep for both. The prefill is charged what it asked and the tokens the rest, overruns and the
                # carry that paid them off included: sharing out what the sleep took as asked let a carry from
                # token-only sleeps shorten the prefill's share, and the tokens' rate came out faster than asked
                # (9.98 ms for 10 asked, a CI run of 6b87e22).
                self.clock.add_prefill(prefill)
                took -= prefill
            self.clock.add(asked - prefill, took, drafted)

    def accept(self, context, ahead=()):
        pass

    def close(self):
        pass


K_MAX = 8


def record_tables(address, tokenizer, prompt_ids, max_tokens, model_path: str | None = None
                  ) -> tuple[list[dict[int, list[int]]], list[list[int]], list[dict[int, list[float]]]]:
    """Per prompt: context length -> the real drafter's greedy proposal of K_MAX tokens there; the greedy
    outputs (prompt included) they were recorded along; and context length -> the drafter's confidence in each
    token of its proposal."""
    drafter = create_drafter("llama-cpp", DrafterOptions(model_path=model_path, context_size=512))
    tables, confidences = [], []
    fulls = greedy_outputs(address, tokenizer, prompt_ids, max_tokens)
    for ids, full in zip(prompt_ids, fulls):
        drafter.begin(list(ids), SamplingParams())
        proposals = {n: drafter.propose(full[:n], K_MAX) for n in range(len(ids), len(full))}
        tables.append({n: p.token_ids for n, p in proposals.items()})
        confidences.append({n: p.confidence for n, p in proposals.items()})
    drafter.close()
    return tables, fulls, confidences


def match_rate(tables: list[dict[int, list[int]]], fulls: list[list[int]]) -> tuple[float, list[float]]:
    """How often a recorded draft's token is the target's greedy token, given that the draft's tokens before it
    were: overall and per draft position. This is the probability `--draft-match` synthesizes drafts with, so a GPU
    run with a random target replays the acceptance measured here with the real models."""
    hit, seen = np.zeros(K_MAX), np.zeros(K_MAX)
    for table, full in zip(tables, fulls):
        for n, draft in table.items():
            for i, tok in enumerate(draft[:len(full) - n]):
                seen[i] += 1
                if tok != full[n + i]:
                    break
                hit[i] += 1
    per = [float(h / s) if s else float("nan") for h, s in zip(hit, seen)]
    return float(hit.sum() / seen.sum()) if seen.sum() else float("nan"), per


def greedy_outputs(address, tokenizer, prompt_ids, max_tokens) -> list[list[int]]:
    """Per prompt: the prompt and the target's greedy output after it (the server decoding every token)."""
    jobs = [Job(create_drafter("none"), Request(ids, max_tokens=max_tokens)) for ids in prompt_ids]
    return [list(ids) + r.token_ids for ids, r in zip(prompt_ids, run(address, tokenizer, jobs).results)]


def synthesize_tables(fulls: list[list[int]], prompt_lens: list[int], match: float, vocab_size: int,
                      seed: int = 0) -> list[dict[int, list[int]]]:
    """Per prompt: context length -> K_MAX drafted tokens, each the target's greedy next token with probability
    `match`, else a different token. Seeded, so every mode and K replays the same drafts."""
    rng = np.random.default_rng(seed)
    tables = []
    for full, start in zip(fulls, prompt_lens):
        table = {}
        for n in range(start, len(full)):
            draft = []
            for tok in full[n:n + K_MAX]:
                draft.append(
                    tok if rng.random() < match else int((tok + 1 + rng.integers(vocab_size - 1)) % vocab_size)
                )
            table[n] = draft
        tables.append(table)
    return tables


def drafting_ms_alone(drafter, prompt: list[int], tokens: int, runs: int = 3) -> list[float]:
    """A drafter alone: ms per token of each of `runs` runs of `tokens` greedy tokens after `prompt` (the first run
    also prefills the prompt; the later ones find it in the drafter's KV cache)."""
    out = []
    for _ in range(runs):
        context = list(prompt)
        drafter.begin(context, SamplingParams())
        t1 = time.perf_counter()
        for _ in range(tokens):
            context += drafter.propose(context, 1).token_ids
        out.append((time.perf_counter() - t1) / tokens * 1000)
    return out


def prefill_tokens(prompt_ids: list[list[int]]) -> list[int]:
    """Per prompt: the tokens a device's drafter prefills for it when its last request was the prompt before it (the
    devices take the prompts in turn), past the first: the drafter's KV cache keeps the common prefix (the chat
    template's system prompt) and feeds the rest in one batch, whose last token's cost is that of a drafting step."""
    return [max(0, len(ids) - common_prefix(prompt_ids[i - 1], ids) - 1) for i, ids in enumerate(prompt_ids)]


def measure_prefill(drafter, prompt_ids: list[list[int]], seconds_per_token: float, passes: int = 2,
                    tokens: int = 8) -> tuple[float, list[float]]:
    """The real drafter's prefill time per prompt token (prefill_tokens), as a device meets it: requests of `tokens`
    tokens through the prompts in turn, `passes` times (the first pass uncounted: its first prompt finds a cache
    from elsewhere); each request's first token takes a drafting step plus the prefill. Returns the median over the
    counted requests, in seconds per token, and each one's ms."""
    counts, samples = prefill_tokens(prompt_ids), []
    for rep in range(passes):
        for ids, n in zip(prompt_ids, counts):
            context = list(ids)
            t0 = time.perf_counter()
            context += drafter.propose(context, 1).token_ids
            first = time.perf_counter() - t0
            for _ in range(tokens - 1):
                context += drafter.propose(context, 1).token_ids
            if rep and n:
                samples.append((first - seconds_per_token) / n)
    per = max(0.0, float(np.median(samples))) if samples else 0.0
    return per, [x * 1000 for x in samples]


def device_only_rate(seconds_per_token: float, prefill_s: list[float], max_tokens: int) -> float:
    """One device's drafter alone, in tokens/s over requests of max_tokens: their drafting steps and, per request,
    its prompt's prefill (the mean over the prompts, which the devices take in turn)."""
    return max_tokens / (max_tokens * seconds_per_token + (float(np.mean(prefill_s)) if prefill_s else 0.0))
