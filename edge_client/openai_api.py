"""The device agent's local OpenAI-compatible HTTP API (aiohttp): completions, chat, streaming, models, health."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import time
import uuid

from aiohttp import web

from pydantic import ValidationError

from .agent import Agent, AgentBusy, Completion
from .api_models import ChatRequest, CompletionRequest, first_problem
from .sampling import SamplingParams
from .tokenizer import takes_tools
from .tool_calls import Call, CallStream, tool_format
from .transport import VerifyError

log = logging.getLogger(__name__)


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
           code: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": code}},
                             status=status)


def _busy(message: str) -> web.Response:
    resp = _error(503, message, "server_error")
    resp.headers["Retry-After"] = "1"
    return resp


class Refused(Exception):
    """A request answered with an OpenAI error before any generation."""

    def __init__(self, response: web.Response):
        self.response = response


def _refused(err: VerifyError) -> web.Response:
    """A verify server's refusal or a lost link, as the local API answers it: what the request asked that the server
    cannot do is the request's fault (400); a server that cannot be reached is unavailable (503); else a bad gateway."""
    if err.code in ("INVALID_ARGUMENT", "OUT_OF_RANGE"):
        return _error(400, f"verify server: {err.message}")
    return _error(503 if err.unreachable else 502, f"verify server: {err}", "server_error")


def _sampling(req, agent: Agent) -> tuple[SamplingParams, int]:
    sampling = SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                              top_k=req.top_k or 0, top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed)
    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens or agent.config.default_max_tokens
    return sampling, max_tokens


def with_tools(messages: list[dict], told: str | None) -> list[dict]:
    """The messages with what the model is told of the functions it must call, as (or before) the system message."""
    if told is None:
        return messages
    if messages[0]["role"] == "system":
        return [{"role": "system", "content": told + "\n\n" + messages[0]["content"]}] + messages[1:]
    return [{"role": "system", "content": told}] + messages


def tool_call(text: str) -> dict:
    """A forced call's text ({"name": ..., "arguments": {...}}, as its constraint made it) as OpenAI's tool call."""
    return Call(**json.loads(text)).openai()


def _usage(c: Completion) -> dict:
    p, n = len(c.result.prompt_token_ids), len(c.result.token_ids)
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}


def _sled(c: Completion) -> dict:
    s = c.result.stats()
    keys = ("rounds", "draft_tokens", "accepted_tokens", "loosely_accepted_tokens", "acceptance_rate",
            "mean_acceptance_length", "tokens_per_second", "reconnects", "unverified_tokens",
            "unverified_token_indices", "forced_tokens", "drafter")
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
                refused = (
                    "an API key is required: send it as 'Authorization: Bearer <key>' (the OpenAI client's api_key)"
                )
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

    async def _parse(self, request: web.Request, model):
        """The request body as `model`, or Refused with OpenAI's error: 400 for a bad body, 404 for another model."""
        try:
            req = model.model_validate_json(await request.read())
        except ValidationError as err:
            message, param = first_problem(err)
            raise Refused(_error(400, message, param=param)) from None
        if req.model is not None and req.model != self.agent.config.model_name:
            raise Refused(_error(404, f"The model '{req.model}' does not exist: this device agent serves "
                                      f"'{self.agent.config.model_name}'", param="model", code="model_not_found"))
        return req

    async def _encode(self, text: str) -> list[int]:
        """Tokenized off the event loop: a large prompt takes seconds, and /health and other requests go on."""
        ids = await asyncio.to_thread(self.agent.tokenizer.encode, text)
        if not ids:
            raise Refused(_error(400, "'prompt' tokenizes to nothing", param="prompt"))
        return ids

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            req = await self._parse(request, CompletionRequest)
            if req.text is not None:
                prompt_ids = await self._encode(req.text)
            else:
                prompt_ids = list(req.prompt)
                if max(prompt_ids) >= self.agent.tokenizer.vocab_size:
                    raise Refused(_error(400, f"prompt token ids must be in 0..{self.agent.tokenizer.vocab_size - 1}",
                                         param="prompt"))
        except Refused as refused:
            return refused.response
        return await self._run(request, req, prompt_ids, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            req = await self._parse(request, ChatRequest)
            template = self.agent.tokenizer.chat_template
            if template is None:
                raise Refused(_error(400, f"{self.agent.tokenizer.path.name} carries no chat template",
                                     param="messages"))
            fmt, tools = tool_format(template), req.auto_tools()
            native = takes_tools(template)  # the template writes the tools and past calls itself
            try:
                messages = [m.plain() for m in req.messages]
            except ValueError as err:
                raise Refused(_error(400, f"'messages': {err}", param="messages")) from None
            if not native:
                messages = [fmt.history(m) if m["role"] == "tool" or "tool_calls" in m else m for m in messages]
            told = req.tool_prompt() or (fmt.prompt(tools) if tools and not native else None)
            text = await asyncio.to_thread(self.agent.tokenizer.chat_prompt, with_tools(messages, told),
                                           tools=tools if native else None)
            prompt_ids = await self._encode(text)
        except Refused as refused:
            return refused.response
        auto = (fmt, {t["function"]["name"] for t in tools}) if tools else None
        return await self._run(request, req, prompt_ids, chat=True, auto=auto)

    async def _run(self, request, req, prompt_ids, chat, auto=None):
        """Generate and answer. `auto`: the tool-call format and the tools' names where the model may call a tool
        (tool_choice auto): calls found in its answer are answered as tool_calls."""
        sampling, max_tokens = _sampling(req, self.agent)
        stops, stream = req.stops, req.stream
        calls = chat and bool(req.forced_tools())  # a forced tool call: answered as tool_calls
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        model = self.agent.config.model_name
        obj = "chat.completion" if chat else "text_completion"
        busy = self.agent.busy()
        if busy:  # before a stream's headers: a 503, not an error inside a 200 stream; complete() checks it again
            return _busy(busy)
        try:  # a verification rule the request cannot take (a greedy-only rule, sampled): a 400 before the headers
            self.agent.policy.check(sampling)
        except ValueError as err:
            return _error(400, str(err), param="temperature")
        field = None
        try:  # a constraint the grammar library cannot compile: a 400 naming its field, before the headers
            field = req.constraint_field()
            constraint = req.constraint()
            if constraint is not None:
                await asyncio.to_thread(constraint.grammar)
        except ValueError as err:
            message = str(err) if str(err).startswith("'") or field is None else f"'{field}': {err}"
            return _error(400, message, param=field)
        try:
            asked = self.agent.request(prompt_ids, sampling, max_tokens, constraint)
        except ValueError as err:
            return _error(400, str(err))
        try:  # likewise a prompt too long for the device's or the server's context: a 400 before the headers
            await self.agent.check_fits(len(prompt_ids), max_tokens)
        except ValueError as err:
            return _error(400, str(err), param="max_tokens")

        def gone() -> bool:  # the app closed its connection: nobody to answer, the drafter slot is wanted
            return request.transport is None or request.transport.is_closing()

        if not stream:
            try:
                c = await self.agent.complete(asked, stops, gone=gone)
            except ValueError as err:
                return _error(400, str(err))
            except VerifyError as err:
                return _refused(err)
            choice = ({"index": 0, "message": {"role": "assistant", "content": c.text}} if chat
                      else {"index": 0, "text": c.text, "logprobs": None})
            choice["finish_reason"] = c.finish_reason
            if calls and c.finish_reason == "stop":  # the call is complete: OpenAI's tool_calls, not text
                choice["message"] = {"role": "assistant", "content": None, "tool_calls": [tool_call(c.text)]}
                choice["finish_reason"] = "tool_calls"
            elif auto is not None and c.finish_reason == "stop":
                content, found = auto[0].parse(c.text, auto[1])
                if found:
                    choice["message"] = {"role": "assistant", "content": content,
                                         "tool_calls": [f.openai() for f in found]}
                    choice["finish_reason"] = "tool_calls"
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
        # a tool call's text is sent whole once complete, as OpenAI's tool-call delta
        held = CallStream(*auto) if auto is not None else None  # auto: text streams, a call is held to the end

        def heard(t, ok):
            if held is not None:
                t = held.feed(t)
            if t and not calls:
                queue.put_nowait(event(t, ok))
        task = asyncio.create_task(self.agent.complete(asked, stops, on_text=heard, gone=gone))
        task.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            while True:
                item = await queue.get()
                if item is None:
                    break
                await resp.write(f"data: {json.dumps(item)}\n\n".encode())
            try:
                c = task.result()
                finish = c.finish_reason
                if calls and finish == "stop":
                    delta = event(None)
                    delta["choices"][0]["delta"] = {"tool_calls": [{"index": 0, **tool_call(c.text)}]}
                    await resp.write(f"data: {json.dumps(delta)}\n\n".encode())
                    finish = "tool_calls"
                elif calls:  # cut short: the text as it came
                    await resp.write(f"data: {json.dumps(event(c.text))}\n\n".encode())
                elif held is not None:
                    rest, found = held.finish() if finish == "stop" else (held.text[held.sent:], [])
                    if rest:
                        await resp.write(f"data: {json.dumps(event(rest))}\n\n".encode())
                    for i, f in enumerate(found):
                        delta = event(None)
                        delta["choices"][0]["delta"] = {"tool_calls": [{"index": i, **f.openai()}]}
                        await resp.write(f"data: {json.dumps(delta)}\n\n".encode())
                    finish = "tool_calls" if found else finish
                final = event(None if chat else "", finish=finish, extra={"sled": _sled(c)})
                if req.stream_options is not None and req.stream_options.include_usage:
                    final["usage"] = _usage(c)
                await resp.write(f"data: {json.dumps(final)}\n\n".encode())
            except (VerifyError, ValueError, AgentBusy) as err:
                await resp.write(f"data: {json.dumps({'error': {'message': str(err), 'type': 'server_error'}})}\n\n"
                                 .encode())
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionResetError:  # the local app went away mid-stream: nothing to answer, nothing wrong here
            task.cancel()  # its session is closed
            log.info("%s: the app closed its connection mid-stream; generation stopped", rid)
        except asyncio.CancelledError:
            task.cancel()
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
