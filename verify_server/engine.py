"""The engine worker: it alone owns the model and the KV pool. Any thread hands it messages (open, verify, close) and
gets answers through callbacks; its own thread runs step() = plan → batch → forward → sample → commit."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import queue
import random
import threading
import time
import uuid
from collections import OrderedDict
from concurrent import futures
from concurrent.futures import Executor
from typing import Callable

import torch

from kernels.cpu_step import machine_id, row_argmax
from kernels.rejection_sampler import NonFiniteLogitsError, rejection_sample

from .batch import StepBatch, step_lengths
from .constraint import Grammars, commit
from .config import ServerConfig
from .cost_model import StepCostModel
from .errors import SledError, exhausted
from .kv_cache import KVCache, KVLayout, chain_hashes
from .metrics import Metrics
from .model_loader import Target
from .model_runner import ModelInput, ModelRunner
from .scheduler import Plan, Scheduler, VerifyWork, draft_expected
from .sessions import LENGTH, DraftRequest, OpenRequest, Session, Verdict, commit_tokens
from .start_cache import StartCache
from .step_floor import StepFloor

log = logging.getLogger(__name__)

Reply = Callable[[object], None]  # receives a result or an exception
# The config fields a step's cost depends on: the start cache's key names the target's shape by them.
SHAPE_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "sliding_window")


def build_compute(config: ServerConfig, target: Target, attention: str = "sdpa",
                  shard=None) -> tuple[KVCache, ModelRunner]:
    """The KV pool and runner of the target, or of this rank's shard of it (tensor_parallel.Shard). Every rank's
    pool has the same blocks: the leader's block tables travel in each step's input."""
    mcfg = target.model.config
    head_dim = getattr(mcfg, "head_dim", None) or mcfg.hidden_size // mcfg.num_attention_heads
    param = next(target.model.parameters())
    context = getattr(mcfg, "max_position_embeddings", None)
    if context and config.max_seq_len > context:
        raise ValueError(f"max_seq_len {config.max_seq_len} is past the target's context length {context} "
                         "(its max_position_embeddings)")
    kv_heads = mcfg.num_key_value_heads // (shard.world if shard is not None else 1)  # the KV pool by KV head
    kv = KVCache.create(KVLayout(mcfg.num_hidden_layers, kv_heads, head_dim, param.dtype, param.device),
                        kv_cache_tokens(config, mcfg, kv_heads, head_dim, param, shard), config.kv_block_size,
                        config.max_seq_len, config.prefix_cache_tokens)
    runner = ModelRunner(target.model, kv, attention, config.linear, config.fused, config.fused_max_tokens, shard)
    if config.compile == "on" or (config.compile == "auto" and param.device.type == "cuda"
                                  and (shard is None or shard.world == 1)):
        from .compiled import CompiledStep

        runner.compiled = CompiledStep(runner, config.max_batch_tokens)
    return kv, runner


def kv_cache_tokens(config: ServerConfig, mcfg, kv_heads: int, head_dim: int, param: torch.Tensor,
                    shard=None) -> int:
    """The pool's size in tokens: kv_cache_tokens where set; else, on CUDA, kv_memory_fraction of the memory
    free once the weights are loaded (vLLM's way; the least over tensor-parallel ranks), and elsewhere
    max_sessions x max_seq_len."""
    if config.kv_cache_tokens:
        return config.kv_cache_tokens
    if param.device.type != "cuda":
        return config.max_sessions * config.max_seq_len
    free, _ = torch.cuda.mem_get_info(param.device)
    per_token = 2 * mcfg.num_hidden_layers * kv_heads * head_dim * param.element_size()
    tokens = int(free * config.kv_memory_fraction) // per_token
    if shard is not None and shard.world > 1:
        tokens = shard.least(tokens, param.device)
    log.info("KV pool: %d tokens, %.0f%% of the %.1f GiB free on %s", tokens, 100 * config.kv_memory_fraction,
             free / 2**30, param.device)
    return max(tokens, config.max_seq_len)


class Mirrored:
    """`inner`, some of its methods run on every tensor-parallel rank (tensor_parallel.Leader.mirror)."""

    def __init__(self, inner, leader, methods: dict[str, str]):
        self._inner = inner
        for method, command in methods.items():
            setattr(self, method, leader.mirror(command, getattr(inner, method)))

    def __getattr__(self, name):
        return getattr(self._inner, name)


class Engine:
    def __init__(self, config: ServerConfig, target: Target, attention: str = "sdpa", leader=None):
        """leader (tensor_parallel.Leader): target holds rank 0's shard; every call that touches the shards is
        mirrored to the other ranks."""
        self.config = config
        self.target = target
        self.kv, self.runner = build_compute(config, target, attention, leader.shard if leader is not None else None)
        if leader is not None:
            self.runner = Mirrored(self.runner, leader, {"forward": "forward"})
        if config.min_step_ms or config.min_step_ms_per_token:
            self.runner = StepFloor(self.runner, config.min_step_ms, config.min_step_ms_per_token)
        self._kernels = self.runner.kernels()
        self.scheduler = Scheduler(config)
        self.metrics = Metrics(max_positions=config.max_draft_tokens)
        self.vocab_size = self.runner.vocab_size
        self.eos_ids = frozenset(target.eos_token_ids)
        self.grammars = Grammars(target.tokenizer, self.vocab_size, target.eos_token_ids)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sessions: dict[str, Session] = {}
        self._gauges()
        self._expired: OrderedDict[str, str] = OrderedDict()
        self._pending: list[VerifyWork] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop_done: futures.Future | None = None
        self._seeds = random.Random(config.seed)
        self._default_gen = torch.Generator().manual_seed(self._seeds.getrandbits(63))
        self._last_sweep = time.monotonic()
        self.costs = StepCostModel()
        self._last_step_end = 0.0  # time.monotonic() when the last step ended

    # ---- API for any thread: messages to the worker, answered through `reply` ----

    def open(self, request: OpenRequest, reply: Reply, on_verdict: Reply | None = None) -> None:
        """Open a session; `reply` gets it. A session the server decodes (request.server_decodes) is verified with an
        empty draft at every step until it finishes, each Verdict (or error) handed to `on_verdict`."""
        self._inbox.put(("open", (request, on_verdict), reply))

    def verify(self, session_id: str, draft: DraftRequest, reply: Reply) -> None:
        self._inbox.put(("verify", (session_id, draft, time.monotonic()), reply))

    def close(self, session_id: str) -> None:
        self._inbox.put(("close", session_id, None))

    def stats(self) -> dict:
        m = self.metrics
        return {
            "active_sessions": len(self._sessions),
            "free_slots": self.free_sessions(),
            **self.kv_stats(),
            "steps": m.steps,
            "max_step_sessions": m.max_step_sessions,
            "verifications": m.verifications,
            "drafts": m.drafts,
            "draft_tokens": m.draft_tokens,
            "accepted_tokens": m.accepted_tokens,
            "emitted_tokens": m.emitted_tokens,
            "prefill_tokens": m.prefill_tokens,
            "step_seconds_total": m.step_seconds_total,
            "queue_wait_seconds_total": m.queue_wait_seconds_total,
            "forward_seconds_total": m.forward_seconds_total,
            "sessions_opened": m.sessions_opened,
            "prefix_cache_hit_tokens": m.prefix_cache_hit_tokens,
            "loosely_accepted_tokens": m.loosely_accepted_tokens,
            "constrained_draft_tokens": m.constrained_draft_tokens,
            "constrained_accepted_tokens": m.constrained_accepted_tokens,
        }

    def free_sessions(self) -> int:
        """Sessions that may still open (max_sessions less those held)."""
        return max(0, self.config.max_sessions - sum(1 for s in self._sessions.values() if s.holds))

    def kv_stats(self) -> dict:
        pool = self.kv.blocks
        return {"kv_block_size": pool.block_size, "kv_blocks_total": pool.num_blocks, "kv_blocks_used": pool.num_used,
                "kv_blocks_free": pool.num_free, "kv_blocks_shared": pool.num_shared,
                "kv_blocks_cached": pool.num_cached}

    def _gauges(self) -> None:
        self.metrics.free_slots.set(self.free_sessions())
        self.metrics.set_kv_blocks(self.kv.blocks.num_used, self.kv.blocks.num_free, self.kv.blocks.num_shared)

    def kernels(self) -> dict:
        """The runner's kernels (ModelRunner.kernels), as of the warm-up's calibration; kept once the runner is let
        go at stop."""
        runner = self.runner  # stop() lets go of it from another thread
        if runner is not None:
            self._kernels = runner.kernels()
        return self._kernels

    # ---- lifecycle ----

    def warmup(self) -> None:
        """Passes of several sizes, so the first real step is not the slow one and the cost model has data; where
        the fused CPU step runs and fused_max_tokens is not set, first the measurement that sets it."""
        blocks: list[int] = []
        bs = self.kv.block_size
        try:  # blocks for the largest size the calibration times, or as many as the pool has
            self.kv.grow(blocks, min(self.kv.max_seq_len, 256, self.kv.num_blocks * bs))
            if self.runner.compiled is not None:
                self.runner.compiled.warmup(blocks)
            if self.runner.fused is not None and self.config.fused_max_tokens is None:
                self._fused_threshold(blocks)
            for n in (8, 1, 5, 1, 16, 1, 16):
                n = min(n, len(blocks) * bs)
                t0 = time.monotonic()
                self.runner.forward(ModelInput.placeholder(n, blocks, bs))
                self.costs.record(n, time.monotonic() - t0)
        finally:
            self.kv.release(blocks)

    def _fused_threshold(self, blocks: list[int]) -> None:
        """fused_max_tokens as kept from an earlier start with the same key, else measured (within the time bound)
        and kept; a calibration the bound cut is kept as far as it went, and the next start goes on from there."""
        cache = StartCache(self.config.start_cache_folder())
        key = self.start_key()
        kept = cache.get("fused", key)
        if kept is not None and kept.get("complete", True):
            self.runner.set_fused_max_tokens(int(kept["fused_max_tokens"]))
            log.info("fused step up to %d tokens, as measured at an earlier start (%s)",
                     self.runner.fused_max_tokens, cache.path("fused", key))
            return
        try:
            known = {int(n): float(r) for n, r in kept["ratios"].items()} if kept is not None else {}
        except (KeyError, TypeError, ValueError, AttributeError):
            known = {}
        t0 = time.monotonic()
        done = self.runner.calibrate_fused(blocks, budget_s=self.config.calibration_budget_s, known=known)
        ratios = ", ".join(f"{n}: {r:.2f}" for n, r in done.ratios.items())
        cache.put("fused", key, {"fused_max_tokens": done.max_tokens, "complete": not done.cut,
                                 "ratios": {str(n): r for n, r in done.ratios.items()}})
        if done.cut:
            log.warning("the fused step's calibration was cut at its %gs bound (calibration_budget_s) after %.0fs: "
                        "fused up to %d tokens, a safe default (fused / PyTorch: %s); the next start goes on from "
                        "there", self.config.calibration_budget_s, time.monotonic() - t0, done.max_tokens, ratios)
            return
        log.info("fused step up to %d tokens, measured in %.0fs%s (fused / PyTorch: %s)", done.max_tokens,
                 time.monotonic() - t0, " after an earlier start's part" if known else "", ratios)

    def start_key(self) -> dict:
        """What start-up measurements depend on: machine, target, dtype, threads, kernels and their builds."""
        runner, mcfg = self.runner, self.target.model.config
        shape = {name: getattr(mcfg, name, None) for name in SHAPE_FIELDS}
        return {"machine": machine_id(), "target": self.target.name,
                "shape": hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:16],
                "dtype": str(runner.dtype), "threads": torch.get_num_threads(), "torch": torch.__version__,
                "linear": runner.linear, "attention": runner.attention_name,
                # the fused step's threshold is measured against the other path: the compiled step where it is on
                "compiled": runner.compiled.attention if runner.compiled is not None else "",
                "max_seq_len": self.kv.max_seq_len,
                "kv_block_size": self.kv.block_size,
                "fused_build": runner.fused.build if runner.fused is not None else ""}

    def start(self, executor: Executor | None = None) -> None:
        """Run the step loop on `executor`'s thread, best the one that built the engine (see VerifyServer), or
        on a new thread."""
        if executor is not None:
            self._loop_done = executor.submit(self._run)
        else:
            self._thread = threading.Thread(target=self._run, name="sled-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._loop_done is not None:
            futures.wait([self._loop_done], timeout=30)
        for work in self._pending:
            work.reply(SledError("UNAVAILABLE", "server is shutting down; reopen with the full context"))
        self._pending.clear()
        worker_done = ((self._thread is None or not self._thread.is_alive())
                       and (self._loop_done is None or self._loop_done.done()))
        if worker_done:
            # A stopped engine runs no more steps: let go of the runner (the weights' packed copies) now. grpc.aio
            # keeps calls that were open at stop, and through them this engine, for as long as the process lives.
            self.runner = None

    # ---- the worker ----

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain(self._next_timeout())
            now = time.monotonic()
            if self._ready(now):
                try:
                    self.step()
                except Exception:  # noqa: BLE001 - the worker must survive anything one batch does
                    log.exception("engine step failed")
            if now - self._last_sweep > 1.0:
                self._sweep(now)
                self._last_sweep = now

    def _prefilling(self) -> list[Session]:
        return [s for s in self._sessions.values() if not s.finished and not s.prefilled]

    def _ready(self, now: float) -> bool:
        # The batching window counts from the worker's intake, not from arrival: a draft handed in during a step
        # still waits up to max_wait_ms after it, so the devices that step just answered can join the next one.
        # Drafts of sessions still prefilling cannot run yet: they neither open the window nor stop a hold.
        runnable = self._runnable()
        prefilling = self._prefilling()
        if prefilling and not runnable:
            return self.scheduler.hold(runnable, list(self._sessions.values()), now) <= 0
        oldest = runnable[0].enqueued if runnable else None
        return self.scheduler.ready(self._pending, prefilling, self._in_rounds(now), oldest, now)

    def _runnable(self) -> list[VerifyWork]:
        return [w for w in self._pending if w.session.prefilled]

    def _in_rounds(self, now: float) -> int:
        """Sessions a step may wait for: a draft waiting, a prompt to prefill, or a draft due (not idle ones)."""
        waiting = {w.session.id for w in self._pending}
        return sum(1 for s in self._sessions.values() if not s.finished and (
            s.id in waiting or not s.prefilled or draft_expected(s, now) is not None))

    def _next_timeout(self) -> float:
        now = time.monotonic()
        if self._ready(now):
            return 0.0
        runnable = self._runnable()
        if runnable:
            return max(0.0, self.config.max_wait_ms / 1000.0 - (now - runnable[0].enqueued))
        if self._prefilling():
            return self.scheduler.hold(runnable, list(self._sessions.values()), now)
        return 0.2

    def _drain(self, timeout: float) -> None:
        try:
            item = self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, payload, reply: Reply | None) -> None:
        try:
            if kind == "open":
                reply(self._open(*payload))
            elif kind == "verify":
                self._enqueue_verify(*payload, reply)
            elif kind == "close":
                self._close(payload)
        except SledError as err:
            if reply is not None:
                reply(err)
        except Exception as err:  # noqa: BLE001 - the worker must outlive any one message
            log.exception("engine failed on a %s message", kind)
            if reply is not None:
                reply(SledError("INTERNAL", f"the server failed on this {kind}: {err}"))

    def _open(self, req: OpenRequest, on_verdict: Reply | None = None) -> Session:
        cfg = self.config
        device = req.device
        limit = cfg.max_sessions_per_device
        if limit and sum(1 for s in self._sessions.values() if s.device == device and s.holds) >= limit:
            self.metrics.record_refusal(device.label, "max_sessions_per_device")
            log.warning("refused a session of %s: it holds %d, max_sessions_per_device", device.name, limit)
            raise exhausted(f"device {device.name} already holds {limit} sessions, this server's "
                            "max_sessions_per_device: close one first")
        if not self.free_sessions():
            self.metrics.record_refusal(device.label, "kv_full")
            raise exhausted(f"all {cfg.max_sessions} sessions are in use (max_sessions); retry later or raise "
                            "max_sessions")
        context = list(req.context_token_ids)
        hashes = chain_hashes(context[:-1], self.kv.block_size)  # the last token is computed with the first verify
        blocks = self.kv.blocks.lookup(hashes)
        shared = len(blocks)
        try:
            self.kv.grow(blocks, len(context))  # the whole prompt's blocks now: a prompt that fits is prefilled
        except SledError:
            self.kv.release(blocks)
            self.metrics.record_refusal(device.label, "kv_full")
            raise
        seed = req.sampling.seed
        if seed is None and cfg.seed is not None:
            seed = self._seeds.getrandbits(63)
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        session = Session(id=uuid.uuid4().hex, blocks=blocks, tokens=context,
                          sampling=req.sampling, remaining=req.max_tokens,
                          stop_ids=self.eos_ids | req.stop_token_ids, generator=gen, client_id=req.client_id,
                          device=device, decoded_here=req.server_decodes and on_verdict is not None, rule=req.rule,
                          matcher=req.matcher)
        session.kv_len = session.published = shared
        session.kv_len *= self.kv.block_size
        session.chain = hashes[shared - 1] if shared else b""
        session.answered_at = time.monotonic()  # Opened: counts where the prefix cache held the whole prompt
        if session.kv_len:
            self.metrics.record_prefix_hit(session.kv_len)
        self._sessions[session.id] = session
        if req.server_decodes and on_verdict is not None:  # its first token is asked now, the next at each verdict
            self._pending.append(VerifyWork(session, DraftRequest.empty(0), on_verdict))
        self.metrics.record_open(device.label)
        self.metrics.active_sessions.set(len(self._sessions))
        self._gauges()
        log.info("session %s opened for %s%s: %d context tokens", session.id, device.name,
                 f" ({req.client_id})" if req.client_id else "", len(session.tokens))
        return session

    def _enqueue_verify(self, session_id: str, draft: DraftRequest, arrived: float, reply: Reply) -> None:
        session = self._sessions.get(session_id)
        if session is None:
            why = self._expired.get(session_id, "it was never opened on this server or was closed")
            raise SledError("NOT_FOUND", f"unknown session {session_id}: {why}; reopen with the full context")
        if session.finished:
            raise SledError("FAILED_PRECONDITION", f"session {session_id} has finished ({session.finish_reason})")
        if any(w.session is session for w in self._pending):
            raise SledError("FAILED_PRECONDITION", "a draft of this session is still being verified; wait for its verdict")
        session.last_active = time.monotonic()
        session.draft_arrived(arrived)
        self._pending.append(VerifyWork(session, draft, reply, arrived=arrived))

    def _close(self, session_id: str) -> None:
        session = self._sessions.pop(session_id, None)
        if session is None:
            return
        log.info("session %s of %s closed: %d tokens generated", session_id, session.device.name, session.generated)
        self._release(session)
        for work in [w for w in self._pending if w.session is session]:
            self._pending.remove(work)
            work.reply(SledError("CANCELLED", "session closed"))
        self.metrics.active_sessions.set(len(self._sessions))
        self._gauges()

    def _release(self, session: Session) -> None:
        if session.holds:
            self.kv.release(session.blocks)
            session.holds = False

    def _publish(self, session: Session) -> None:
        """Its full blocks of committed tokens not yet published, published under their prefix hashes."""
        bs, done = self.kv.block_size, session.published
        full = session.kv_len // bs
        if full > done:
            hashes = chain_hashes(session.tokens[done * bs:full * bs], bs, session.chain)
            self.kv.blocks.publish(session.blocks[done:full], hashes)
            session.published, session.chain = full, hashes[-1]

    def _sweep(self, now: float) -> None:
        busy = {w.session.id for w in self._pending}
        for sid, s in list(self._sessions.items()):
            if sid not in busy and now - s.last_active > self.config.idle_timeout_s:
                log.info("session %s idle for %.0fs: freed", sid, now - s.last_active)
                self._expired[sid] = f"it expired after {self.config.idle_timeout_s:g}s without traffic"
                while len(self._expired) > 4096:
                    self._expired.popitem(last=False)
                self._close(sid)

    # ---- one step ----

    def step(self) -> None:
        prefilling, now = self._prefilling(), time.monotonic()
        chunk = (self.scheduler.prefill_chunk(self._pending, list(self._sessions.values()), now, self.costs)
                 if prefilling else None)
        plan = self.scheduler.plan(self._pending, prefilling, chunk, now)
        if not plan:
            return
        t0 = time.monotonic()
        for work in plan.verifies:
            self._pending.remove(work)
        plan = self._grow(plan)
        if not plan:
            return
        try:
            batch = StepBatch.build(plan, self.config.max_seq_len, self._default_gen, self.kv.block_size)
            logits, forward_s = self._forward(batch)
            verdicts = self._sample(batch, logits)
        except Exception as exc:  # noqa: BLE001 - one batch's failure is its sessions' answer, not the worker's end
            log.exception("step failed")
            for work in plan.verifies:
                work.reply(SledError("INTERNAL", f"verification failed: {exc}"))
            return
        self._commit(batch, verdicts, t0, forward_s)

    def _grow(self, plan: Plan) -> Plan:
        """Each session's blocks grown to hold what this step writes. A verification whose session the pool cannot
        grow is answered RESOURCE_EXHAUSTED and its session closed, which frees its blocks for the others: the
        device holds every committed token and resumes by reopening. (A prompt's blocks are taken at open.)"""
        refused = set()
        for session, length in step_lengths(plan, self.config.max_seq_len):
            try:
                self.kv.grow(session.blocks, length)
            except SledError as err:
                refused.add(session.id)
                work = next(w for w in plan.verifies if w.session is session)
                log.warning("session %s of %s cannot grow: %s", session.id, session.device.name, err.message)
                self._expired[session.id] = "it was closed when the KV pool was full"
                self._close(session.id)
                work.reply(exhausted(f"{err.message}. The session was closed with its {len(session.tokens)} "
                                     "committed tokens; reopen with the full context to resume"))
        if not refused:
            return plan
        return Plan([w for w in plan.verifies if w.session.id not in refused], plan.prefills)

    def _forward(self, batch: StepBatch) -> tuple[torch.Tensor | None, float]:
        tokens = batch.model_input.token_ids.numel()
        t0 = time.monotonic()
        logits = self.runner.forward(batch.model_input) if tokens else None
        forward_s = time.monotonic() - t0
        self.costs.record(int(tokens), forward_s)
        return logits, forward_s

    def _sample(self, batch: StepBatch, logits) -> list[tuple[int, int, int] | SledError]:
        """Each verification's accepted count and next token; a session whose logits are not finite gets an error
        and the others are sampled again without it."""
        live = list(range(len(batch.verifies)))
        results: list = [None] * len(live)
        if logits is not None:
            self.grammars.mask(logits, batch.constrained())
        while live:
            part = batch if len(live) == len(results) else batch.subset(live)
            rows = logits if len(live) == len(results) else logits[batch.logit_rows(live)]
            try:
                ver = rejection_sample(rows, part.spec, part.sampling,
                                       row_argmax=row_argmax if self.runner.fused is not None else None)
            except NonFiniteLogitsError as err:
                bad = {live[j] for j in err.request_indices}
                for i in bad:
                    results[i] = SledError("INTERNAL", "the target produced non-finite logits for this session; "
                                                       "nothing was committed")
                live = [i for i in live if i not in bad]
                continue
            for j, i in enumerate(live):
                results[i] = (int(ver.num_accepted[j]), int(ver.next_token[j]), int(ver.num_loose[j]))
            break
        return results

    def _commit(self, batch: StepBatch, verdicts: list, t0: float, forward_s: float) -> None:
        """Prefilled lengths, each session's committed tokens, one reply per verification; a session the server
        decodes is asked its next token at once."""
        end = time.monotonic()
        for p in batch.plan.prefills:
            p.session.kv_len += p.length
            if p.session.prefilled:
                p.session.answered_at = end  # its device may draft from now on
                self._publish(p.session)
        load = {"step_ms": (end - t0) * 1000.0, "step_tokens": int(batch.model_input.token_ids.numel()),
                "step_sessions": len(batch.verifies), "token_ms": self.costs.token_ms}
        for work, draft, result in zip(batch.verifies, batch.drafts, verdicts):
            if isinstance(result, tuple):  # (accepted, next token, accepted loosely); else the session's error
                try:
                    result = self._commit_one(work, draft, *result)
                except Exception as exc:  # noqa: BLE001 - the session's answer, not every session's hang
                    log.exception("committing a verdict of session %s failed", work.session.id)
                    work.reply(SledError("INTERNAL", f"committing the verdict failed: {exc}"))
                    continue
                # The draft's wait through earlier steps (from its arrival to the end of the last one), not the
                # batching window: the part of its round trip that the other sessions' drafts lengthen.
                result = dataclasses.replace(result, **load,
                                             queue_ms=max(0.0, self._last_step_end - work.arrived) * 1000.0)
                if work.session.decoded_here and not result.finished:
                    self._pending.append(VerifyWork(work.session, DraftRequest.empty(work.draft.round + 1),
                                                    work.reply))
            work.reply(result)
        self._last_step_end = end
        self._gauges()
        self.metrics.record_step(len(batch.verifies), sum(p.length for p in batch.plan.prefills), end - t0,
                                 [t0 - w.arrived for w in batch.verifies], forward_s)

    def _commit_one(self, work: VerifyWork, draft: list[int], n_accepted: int, next_token: int,
                    n_loose: int = 0) -> Verdict:
        s = work.session
        kept, nxt, reason = commit_tokens(draft, n_accepted, next_token, s.stop_ids, s.remaining)
        # a block cut at a stop token or the token budget keeps only the loose acceptances inside it
        n_loose = min(n_loose, kept)
        block = draft[:kept] + ([nxt] if nxt is not None else [])
        if s.matcher is not None:
            commit(s.matcher, block)
        s.tokens.extend(block)
        s.remaining -= len(block)
        s.generated += len(block)
        if reason is None and len(s.tokens) >= self.config.max_seq_len:
            reason = LENGTH
        if reason is not None:
            s.finished, s.finish_reason = True, reason
            self._release(s)
        else:
            s.kv_len = len(s.tokens) - 1
            self.kv.truncate(s.blocks, s.kv_len)  # the rejected draft's positions: whole blocks past it are freed
            self._publish(s)
        s.last_active = s.answered_at = time.monotonic()
        self.metrics.record_verification(len(draft), kept, len(block), s.device.label, n_loose, s.matcher is not None)
        return Verdict(work.draft.round, kept, nxt, reason is not None, reason, n_loose=n_loose)
