"""The device agent's local OpenAI-compatible HTTP API (aiohttp): completions, chat, streaming, models, health."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import math
import time
import uuid

from aiohttp import web

from .agent import Agent, AgentBusy, Completion
from .sampling import SamplingParams
from .transport import VerifyError

log = logging.getLogger(__name__)


class BadRequest(Exception):
    pass


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": None}},
                             status=status)


def _busy(message: str) -> web.Response:
    resp = _error(503, message, "server_error")
    resp.headers["Retry-After"] = "1"
    return resp


def _number(body: dict, name: str, default, lo=None, hi=None, integer=False):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not float(value).is_integer()):
        raise BadRequest(f"'{name}' must be {'an integer' if integer else 'a number'}, got {value!r}")
    if not math.isfinite(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
        raise BadRequest(f"'{name}' must be between {lo} and {hi}, got {value!r}")
    return int(value) if integer else float(value)


def _common(body: dict, agent: Agent) -> tuple[SamplingParams, int, list[str], bool]:
    if body.get("n", 1) not in (1, None):
        raise BadRequest("'n' must be 1: the agent returns one choice per request")
    unsupported = [k for k in ("logprobs", "top_logprobs", "echo", "suffix", "tools", "functions") if body.get(k)]
    if body.get("best_of") not in (None, 1):
        unsupported.append("best_of")
    if unsupported:
        raise BadRequest(f"{', '.join(unsupported)} not supported by the SLED device agent")
    sampling = SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_k=_number(body, "top_k", 0, 0, None, integer=True),
        top_p=_number(body, "top_p", 1.0, 1e-6, 1.0),
        seed=_number(body, "seed", None, 0, 2**63 - 1, integer=True),
    )
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _number({"max_tokens": max_tokens}, "max_tokens", agent.config.default_max_tokens, 1, None, True)
    stop = body.get("stop") or []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > 4:
        raise BadRequest("'stop' must be a string or a list of at most 4 strings")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false")
    return sampling, max_tokens, stops, stream


def _usage(c: Completion) -> dict:
    p, n = len(c.result.prompt_token_ids), len(c.result.token_ids)
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}


def _sled(c: Completion) -> dict:
    s = c.result.stats()
    keys = ("rounds", "draft_tokens", "accepted_tokens", "acceptance_rate", "mean_acceptance_length",
            "tokens_per_second", "reconnects", "unverified_tokens", "unverified_token_indices", "drafter")
    return {k: s[k] for k in keys}


def api_key_check(key: str | None):
    """aiohttp middleware: with a key, the /v1 routes answer 401 (OpenAI's error shape) to a request that does not
    carry `Authorization: Bearer <key>`; /health stays open for liveness probes."""

    @web.middleware
    async def check(request: web.Request, handler):
        if key is not None and request.path.startswith("/v1/"):
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            given = given.strip() if scheme.lower() == "bearer" else ""
            if not given:
                refused = "an API key is required: send it as 'Authorization: Bearer <key>' (the OpenAI client's api_key)"
            elif not hmac.compare_digest(given.encode(), key.encode()):
                refused = "the API key given is not this device agent's"
            else:
                refused = None
            if refused is not None:
                resp = _error(401, refused)
                resp.headers["WWW-Authenticate"] = "Bearer"
                return resp
        return await handler(request)

    return check


def exposure_warning(config) -> str | None:
    """A warning where the local API listens beyond this machine without a key, or None."""
    if config.http_api_key is not None:
        return None
    try:
        if ipaddress.ip_address(config.http_host).is_loopback:
            return None
    except ValueError:  # a host name
        if config.http_host == "localhost":
            return None
    return (f"the local API on {config.http_host} takes requests from anyone who can reach it: set http_api_key "
            "(or --api-key) to ask for a key")


class OpenAIServer:
    def __init__(self, agent: Agent):
        self.agent = agent
        self.app = web.Application(client_max_size=8 * 1024 * 1024,
                                   middlewares=[api_key_check(agent.config.http_api_key)])
        self.app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
        ])

    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BadRequest("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        return body

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if isinstance(prompt, str):
                prompt_ids = self.agent.tokenizer.encode(prompt)
            elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                             for t in prompt):
                prompt_ids = list(prompt)
                if max(prompt_ids) >= self.agent.tokenizer.vocab_size or min(prompt_ids) < 0:
                    raise BadRequest(f"prompt token ids must be in 0..{self.agent.tokenizer.vocab_size - 1}")
            else:
                raise BadRequest("'prompt' must be a non-empty string (or one list of token ids)")
            if not prompt_ids:
                raise BadRequest("'prompt' tokenizes to nothing")
            args = _common(body, self.agent)
        except (BadRequest, ValueError) as err:
            return _error(400, str(err))
        return await self._run(request, body, prompt_ids, *args, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request)
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("'messages' must be a non-empty list")
            clean = []
            for m in messages:
                if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
                    raise BadRequest("each message needs a role of system, user, assistant or developer")
                content = m.get("content")
                if isinstance(content, list):
                    content = "".join(part.get("text", "") for part in content if isinstance(part, dict)
                                      and part.get("type") == "text")
                if not isinstance(content, str):
                    raise BadRequest("each message needs text content")
                clean.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
            prompt_ids = self.agent.tokenizer.encode(self.agent.tokenizer.chat_prompt(clean))
            args = _common(body, self.agent)
        except (BadRequest, ValueError) as err:
            return _error(400, str(err))
        return await self._run(request, body, prompt_ids, *args, chat=True)

    async def _run(self, request, body, prompt_ids, sampling, max_tokens, stops, stream, chat):
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        model = self.agent.config.model_name
        obj = "chat.completion" if chat else "text_completion"
        busy = self.agent.busy()
        if busy:  # before a stream's headers: a 503, not an error inside a 200 stream; complete() checks it again
            return _busy(busy)

        def gone() -> bool:  # the app closed its connection: nobody to answer, the drafter slot is wanted
            return request.transport is None or request.transport.is_closing()

        if not stream:
            try:
                c = await self.agent.complete(prompt_ids, sampling, max_tokens, stops, gone=gone)
            except ValueError as err:
                return _error(400, str(err))
            except VerifyError as err:
                return _error(503 if err.unreachable else 502,
                              f"verify server: {err}", "server_error")
            choice = ({"index": 0, "message": {"role": "assistant", "content": c.text}} if chat
                      else {"index": 0, "text": c.text, "logprobs": None})
            choice["finish_reason"] = c.finish_reason
            return web.json_response({"id": rid, "object": obj, "created": created, "model": model,
                                      "choices": [choice], "usage": _usage(c), "sled": _sled(c)})

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"
        queue: asyncio.Queue = asyncio.Queue()

        def event(text: str | None, verified: bool = True, finish: str | None = None, extra: dict | None = None):
            if chat:
                delta = {} if text is None else {"content": text}
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            msg = {"id": rid, "object": chunk_obj, "created": created, "model": model, "choices": [choice],
                   "sled": {"verified": verified}}
            if extra:
                msg.update(extra)
            return msg

        if chat:
            first = event(None)
            first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            queue.put_nowait(first)
        task = asyncio.create_task(self.agent.complete(
            prompt_ids, sampling, max_tokens, stops, on_text=lambda t, ok: queue.put_nowait(event(t, ok)),
            gone=gone))
        task.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            while True:
                item = await queue.get()
                if item is None:
                    break
                await resp.write(f"data: {json.dumps(item)}\n\n".encode())
            try:
                c = task.result()
                final = event(None if chat else "", finish=c.finish_reason, extra={"sled": _sled(c)})
                if (body.get("stream_options") or {}).get("include_usage"):
                    final["usage"] = _usage(c)
                await resp.write(f"data: {json.dumps(final)}\n\n".encode())
            except (VerifyError, ValueError, AgentBusy) as err:
                await resp.write(f"data: {json.dumps({'error': {'message': str(err), 'type': 'server_error'}})}\n\n"
                                 .encode())
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            task.cancel()  # the local app went away: its session is closed
            raise
        return resp

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.agent.config.model_name, "object": "model",
                                                               "created": 0, "owned_by": "sled"}]})

    async def health(self, request: web.Request) -> web.Response:
        reachable = await self.agent.server_reachable()
        return web.json_response({"status": "ok", "server": self.agent.config.server, "server_reachable": reachable,
                                  "drafter": self.agent.config.drafter, "active_requests": self.agent.active,
                                  "waiting_requests": self.agent.waiting, "served_requests": self.agent.served})


async def serve(config) -> None:
    """Run the device agent until SIGTERM or SIGINT."""
    import signal

    agent = Agent(config)
    server = OpenAIServer(agent)
    runner = web.AppRunner(server.app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.http_host, config.http_port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    print(f"SLED device agent on http://{config.http_host}:{port}/v1 (verify server {config.server}"
          f"{' over TLS' if config.uses_tls else ''}, drafter {config.drafter}"
          f"{', API key required' if config.http_api_key is not None else ''})", flush=True)
    warning = exposure_warning(config)
    if warning:
        log.warning(warning)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")
    await runner.cleanup()
    await agent.close()
