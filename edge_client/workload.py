"""A device's workload for simulations and benchmarks: N generations, one after another, then a summary."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from .config import EdgeConfig
from .drafters import create_drafter
from .generation import generate
from .request import Callbacks, Request
from .sampling import SamplingParams
from .tokenizer import Tokenizer
from .servers import connect

QUESTIONS = [
    "Explain why the sky is blue.", "Write a short story about a robot who learns to paint.",
    "What are the benefits of regular exercise?", "Describe how a bicycle works.",
    "Give me three tips for learning to cook.", "What is photosynthesis?",
    "Write a poem about the ocean.", "How do airplanes stay in the air?",
    "Summarize the plot of Romeo and Juliet.", "What is machine learning?",
    "Describe a day in the life of a farmer.", "Why do we have seasons?",
]


async def run_workload(config: EdgeConfig, requests: int, max_tokens: int, name: str, offset: int = 0,
                       temperature: float = 0.0, log=print) -> dict:
    if requests < 1 or max_tokens < 1 or offset < 0:
        raise ValueError(f"need requests >= 1, max_tokens >= 1 and offset >= 0, got {requests}, {max_tokens}, {offset}")
    SamplingParams(temperature=temperature)  # checks it before the drafter loads
    tokenizer = Tokenizer(config.tokenizer or config.draft_model)
    drafter = create_drafter(config.drafter, config.drafter_options())
    client = connect(config.server, config.token(), config.channel_tls(), affinity=name)
    policy, resilience = config.draft_policy(), config.resilience()
    controller = policy.controller() if policy.adaptive and policy.drafts else None  # kept across requests
    runs = []
    start = time.perf_counter()
    try:
        for i in range(requests):
            q = QUESTIONS[(offset + i) % len(QUESTIONS)]
            ids = tokenizer.encode(tokenizer.chat_prompt([{"role": "user", "content": q}]))
            sampling = SamplingParams(temperature=temperature, seed=offset + i if temperature > 0 else None)
            asked = Request(ids, max_tokens, sampling, policy, client_id=name)
            r = await generate(client, drafter, tokenizer, asked, resilience=resilience, controller=controller,
                               callbacks=Callbacks(on_status=lambda message: log(f"[{name}] {message}")))
            runs.append(r)
            log(f"[{name}] request {i + 1}/{requests}: {len(r.token_ids)} tokens, {r.tokens_per_second:.1f} tok/s, "
                f"acceptance {r.acceptance_rate:.2f}")
    finally:
        await client.close()
        drafter.close()
    wall = time.perf_counter() - start
    tokens = sum(len(r.token_ids) for r in runs)
    drafted = sum(r.draft_tokens for r in runs)
    accepted = sum(r.accepted_tokens for r in runs)
    return {"device": name, "drafter": config.drafter, "requests": len(runs), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall if wall else 0.0,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "unverified_tokens": sum(r.unverified_tokens for r in runs),
            "reconnects": sum(r.reconnects for r in runs)}


def write_summary(summary: dict, path: str | None) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(summary, indent=2))


def main_workload(args) -> int:
    import sys

    from .cli import edge_config
    from .transport import VerifyError

    try:
        config = edge_config(args)
        summary = asyncio.run(run_workload(config, args.requests, args.max_tokens, args.name, args.offset,
                                           args.temperature, log=lambda m: print(m, flush=True)))
    except VerifyError as err:
        print(f"sled-edge workload: {err.summary}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as err:
        print(f"sled-edge workload: {err}", file=sys.stderr)
        return 2
    write_summary(summary, args.json)
    print(json.dumps(summary), flush=True)
    return 0
