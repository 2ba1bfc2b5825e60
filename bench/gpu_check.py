"""One command for a lent GPU: the engine's step against the memory floor and against transformers' compiled static
cache, and the compiled step's greedy agreement with eager.

    sled-bench gpu-check --tokenizer runs/tokenizer

For each shape (default random:llama-1b and random:llama-8b, random weights: no checkpoint travels) and each size
(1x1: one session decoding; 32x5: 32 sessions verifying 4 drafted tokens and the bonus row), over --context cached
tokens a session, the step is timed through:
- `eager`: ModelRunner.forward, PyTorch with the padded attention call (the server's default on CUDA);
- `compiled`: the step compiled whole (verify_server/compiled.py: FlexAttention over the paged pool, CUDA graphs);
- `hf static`: transformers' own forward over its StaticCache, under torch.compile (mode reduce-overhead on CUDA),
  the same tokens at the same positions.
The floor is the weights' bytes over the measured copy bandwidth of the device. Before timing, the compiled step's
greedy tokens are compared with eager's on every row. Synchronized host time, the paths interleaved round by round.
Runs on the CPU too (the test suite runs it with random:llama-tiny); its figures mean something on a GPU.
Writes its section of docs/benchmarks.md and, with --json, the rows.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from .compiled import _sizes as sizes_arg
from .cli import positive
from .gpu_step import sync
from .report import copy_bandwidth, gpu_name, machine, publish

ROOT = Path(__file__).resolve().parent.parent
MARKER = "## GPU check: step against the floor and transformers' compiled static cache"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="random:llama-1b,random:llama-8b",
                   help="targets, comma-separated (default random:llama-1b,random:llama-8b)")
    p.add_argument("--tokenizer", help="a tokenizer folder for the random targets, where the GGUF is not installed")
    p.add_argument("--sizes", type=sizes_arg, default=sizes_arg("1x1,32x5"), help="SESSIONSxTOKENS (default 1x1,32x5)")
    p.add_argument("--context", type=positive(int), default=512, help="cached tokens a session (default 512)")
    p.add_argument("--device", default="auto", help="auto, cuda or cpu (default auto)")
    p.add_argument("--steps", type=positive(int), default=20, help="timed steps per path per round (default 20)")
    p.add_argument("--rounds", type=positive(int), default=3, help="rounds, paths interleaved (default 3)")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    p.add_argument("--markdown", default=str(ROOT / "docs" / "benchmarks.md"), help="file whose section is rewritten")
    return p


def check_shape(spec: str, args, device, dtype) -> list[dict]:
    import torch

    from kernels.attention import Segment
    from verify_server.compiled import CompiledStep
    from verify_server.kv_cache import KVCache, KVLayout
    from verify_server.model_loader import load_target
    from verify_server.model_runner import ModelInput, ModelRunner

    print(f"[bench] {spec} on {device} ({dtype}) ...", flush=True)
    target = load_target(spec, device, dtype, args.tokenizer)
    model, cfg = target.model, target.model.config
    model.requires_grad_(False)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    most, longest = max(n for n, _ in args.sizes), max(t for _, t in args.sizes)
    seq = args.context + longest
    kv = KVCache.create(KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, dtype, device),
                        most * (seq + 16), 16, seq)
    tables = [tuple(kv.blocks.allocate(kv.blocks_for(seq))) for _ in range(most)]
    g = torch.Generator(device=device).manual_seed(0)
    kv.k.normal_(generator=g).mul_(0.5)
    kv.v.normal_(generator=g).mul_(0.5)
    eager = ModelRunner(model, kv, fused="off")
    compiled = ModelRunner(model, kv, fused="off")
    compiled.compiled = CompiledStep(compiled, max(n * t for n, t in args.sizes))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = copy_bandwidth(repeats=5, device=str(device))
    rows = []
    for n, t in args.sizes:
        ids = torch.randint(3, target.vocab_size, (n, t), generator=torch.Generator().manual_seed(n * 100 + t))
        segs = [Segment(tables[s], s * t, t, args.context + t, 16) for s in range(n)]
        inp = ModelInput.build(ids.flatten().tolist(), segs, list(range(n * t)))
        t0 = time.monotonic()
        want, got = eager.forward(inp), compiled.forward(inp)
        compile_s = time.monotonic() - t0
        agree = float((want.argmax(-1) == got.argmax(-1)).float().mean())
        hf = hf_static(model, ids.to(device), args.context, device)
        paths = {"eager": lambda: eager.forward(inp), "compiled": lambda: compiled.forward(inp), "hf static": hf}
        times = {name: [] for name in paths}
        for _ in range(args.rounds):
            for name, run in paths.items():
                run()
                sync(torch, device)
                for _ in range(args.steps):
                    t1 = time.perf_counter()
                    run()
                    sync(torch, device)
                    times[name].append(time.perf_counter() - t1)
        p50 = {name: statistics.median(ts) * 1000 for name, ts in times.items()}
        floor_ms = weight_bytes / bandwidth * 1000
        rows.append({"target": spec, "sessions": n, "tokens": t, "context": args.context, "floor_ms": floor_ms,
                     **{f"{name.replace(' ', '_')}_ms": ms for name, ms in p50.items()},
                     "compiled_over_floor": p50["compiled"] / floor_ms,
                     "hf_static_over_compiled": p50["hf static"] / p50["compiled"],
                     "greedy_agreement": agree, "first_step_with_compile_s": compile_s})
        print(f"[bench] {spec} {n}x{t}: eager {p50['eager']:.2f} ms, compiled {p50['compiled']:.2f} ms, "
              f"hf static {p50['hf static']:.2f} ms, floor {floor_ms:.2f} ms; greedy agreement {agree:.3f}",
              flush=True)
    return rows


def hf_static(model, ids, context: int, device):
    """A step of transformers' own forward over its StaticCache, compiled: the batch's tokens at positions
    [context, context + T), after an eager prefill of `context` tokens."""
    import torch
    from transformers import StaticCache

    n, t = ids.shape
    # 16 spare positions (a block of the pool): a cache of exactly context + t fails an index bound in the
    # compiled mask code of transformers here
    cache = StaticCache(config=model.config, max_cache_len=context + t + 16)
    with torch.inference_mode():
        model(torch.ones(n, context, dtype=torch.long, device=device), past_key_values=cache,
              cache_position=torch.arange(context, device=device), use_cache=True)
    mode = "reduce-overhead" if device.type == "cuda" else None
    forward = torch.compile(model.forward, fullgraph=True, dynamic=False, mode=mode)
    position = torch.arange(context, context + t, device=device)

    def step():
        with torch.inference_mode():
            return forward(ids, past_key_values=cache, cache_position=position, use_cache=True).logits

    return step


def main(args) -> int:
    from verify_server.model_loader import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    dtype = resolve_dtype("auto", device)
    rows = []
    for spec in [s.strip() for s in args.shapes.split(",") if s.strip()]:
        rows += check_shape(spec, args, device, dtype)
    lines = ["| target | sessions × tokens | floor ms | eager ms | compiled ms | hf static ms | compiled / floor | "
             "hf static / compiled | greedy agreement |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['target']} | {r['sessions']} × {r['tokens']} | {r['floor_ms']:.2f} | {r['eager_ms']:.2f} | "
                     f"{r['compiled_ms']:.2f} | {r['hf_static_ms']:.2f} | {r['compiled_over_floor']:.2f}x | "
                     f"{r['hf_static_over_compiled']:.2f}x | {r['greedy_agreement']:.3f} |")
    where = gpu_name() if device.type == "cuda" else machine()
    section = "\n".join([
        MARKER, "",
        f"`sled-bench gpu-check {shlex.join(sys.argv[2:])}` on {where}, {dtype}, "
        f"{datetime.now(timezone.utc):%Y-%m-%d}.", "",
        f"Random-weight targets; each size is N sessions of T new tokens over {args.context} cached tokens. Step "
        f"p50 in ms (synchronized host time, the paths interleaved over {args.rounds} rounds of {args.steps} steps); "
        "the floor is the weights' bytes over the device's copy bandwidth; greedy agreement is the share of rows "
        "where the compiled step's argmax is eager's.", "", *lines, ""])
    publish(args.markdown, MARKER, section, args.json, rows)
    return 0
