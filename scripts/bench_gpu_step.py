"""The target's step on a GPU: a batch of sessions, per-segment attention against one padded call per layer.

    python scripts/bench_gpu_step.py --target random:llama-1b --tokenizer runs/tokenizer

For each session count and tokens per session (1: server-only's decode step; 9: a draft of 8 and its bonus row,
a SLED verification), `ModelRunner.forward` over sessions that each hold --context cached tokens, once with
`--attention segments` (one scaled_dot_product_attention per session and layer) and once with `sdpa` (on CUDA the
short segments of the step in one padded call per layer), interleaved round by round. The time is the host's,
from the call to the logits being on the device (synchronized), so the launch overhead that batching removes
counts. Before timing, the two paths' logits are compared on the same inputs (relative difference and greedy
agreement). The floor is the weights' bytes over the measured device-to-device copy bandwidth.

Then the default path again with a context that grows by one every step, as in real decoding, so every step
meets an attention shape it has not seen: once with the runner's attention kernels (cuDNN's left out) and once with
cuDNN's in PyTorch's choice as well (PyTorch's default).

Runs on CPU as well (a smoke test with --target random:llama-tiny); the figures mean something on a GPU.
Writes its section of docs/benchmarks.md and, with --json, the rows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import copy_bandwidth, gpu_name, machine, publish  # noqa: E402

MARKER = "## GPU step: per-segment attention against one padded call"


def sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_attention(torch, device, dtype, heads: int, kv_heads: int, head_dim: int) -> dict:
    """Both attention paths at the target's head shape against the float32 reference, over a ragged batch (drafts,
    decode tokens and a prompt, unequal contexts) whose cache positions past each context hold NaN. Fresh random
    inputs; relative error ||out - ref|| / ||ref||, NaN counting as failure."""
    from kernels.attention import ATTENTION, Segment, attention_reference

    g = torch.Generator(device=device).manual_seed(1)
    shape = [(s, (9, 1, 9, 5, 40)[s % 5], 60 + 37 * s) for s in range(24)]
    segments, start = [], 0
    for slot, length, context in shape:
        segments.append(Segment(slot, start, length, context))
        start += length
    k = torch.randn(len(shape), kv_heads, 1024, head_dim, generator=g, device=device)
    v = torch.randn(len(shape), kv_heads, 1024, head_dim, generator=g, device=device)
    q = torch.randn(start, heads, head_dim, generator=g, device=device)
    want = attention_reference(q, k, v, segments, head_dim ** -0.5).float()
    for seg in segments:
        k[seg.slot, :, seg.context_len:] = float("nan")
        v[seg.slot, :, seg.context_len:] = float("nan")
    errors = {"what": f"{len(segments)} segments of 1-40 tokens over 60-911 keys, {dtype}"}
    for name in ("sdpa", "segments"):
        prepare, attend = ATTENTION[name]
        qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
        out = attend(qd, kd, vd, segments, head_dim ** -0.5, prepare(segments, device, heads // kv_heads, dtype))
        err = float((out.float() - want).norm() / want.norm())
        errors[name] = err if torch.isfinite(out).all() else float("inf")
    return errors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="random:llama-1b", help="target spec (default random:llama-1b)")
    ap.add_argument("--tokenizer", metavar="DIR", help="tokenizer folder for the random target (export_tokenizer.py)")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda (default auto)")
    ap.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16")
    ap.add_argument("--sessions", default="1,4,16,32", help="session counts (default 1,4,16,32)")
    ap.add_argument("--tokens", default="1,9", help="new tokens per session (default 1,9)")
    ap.add_argument("--context", type=int, default=256, help="cached tokens per session (default 256)")
    ap.add_argument("--steps", type=int, default=30, help="timed forwards per configuration per round (default 30)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, the two paths interleaved (default 3)")
    ap.add_argument("--growing-steps", type=int, default=10,
                    help="timed forwards per round with a context one longer every step (default 10)")
    ap.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    ap.add_argument("--markdown", default=str(ROOT / "docs" / "benchmarks.md"), help="file whose section is rewritten")
    args = ap.parse_args()
    try:
        sessions = [int(x) for x in args.sessions.split(",")]
        tokens = [int(x) for x in args.tokens.split(",")]
    except ValueError:
        ap.error("--sessions and --tokens take comma-separated integers")
    if min(sessions + tokens) < 1 or min(args.context, args.steps, args.rounds, args.growing_steps) < 1:
        ap.error("--sessions, --tokens, --context, --steps, --rounds and --growing-steps must be positive")

    import torch
    from tqdm import tqdm

    from kernels.attention import Segment
    from verify_server.kv_cache import KVCache
    from verify_server.model_loader import load_target, resolve_device, resolve_dtype
    from verify_server.model_runner import ModelInput, ModelRunner

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    print(f"[bench] building {args.target} on {device} ({dtype}) ...", flush=True)
    target = load_target(args.target, device, dtype, args.tokenizer)
    cfg = target.model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    growing = 2 * args.rounds * args.growing_steps  # distinct contexts per configuration, both variants
    top, seq = max(sessions), args.context + growing + max(tokens) + 1
    kv = KVCache(cfg.num_hidden_layers, top, cfg.num_key_value_heads, seq, head_dim, dtype, device)
    g = torch.Generator(device=device).manual_seed(0)
    # Cached keys and values of the scale a real forward writes; positions past the context stay unwritten.
    kv.k[:, :, :, :args.context].normal_(generator=g).mul_(0.5)
    kv.v[:, :, :, :args.context].normal_(generator=g).mul_(0.5)
    runners = {name: ModelRunner(target.model, kv, name, fused="off") for name in ("segments", "sdpa")}
    weight_bytes = sum(p.numel() * p.element_size() for p in target.model.parameters())
    bandwidth = copy_bandwidth(repeats=10, device=device)
    floor_ms = weight_bytes / bandwidth * 1000

    def batch(n: int, t: int, extra: int = 0) -> ModelInput:
        """n sessions of t new tokens each, over args.context + extra cached tokens."""
        ctx = args.context + extra
        segs = [Segment(s, s * t, t, ctx + t) for s in range(n)]
        pos = torch.arange(ctx, ctx + t).repeat(n)
        ids = torch.randint(0, target.vocab_size, (n * t,), generator=torch.Generator().manual_seed(n * 100 + t))
        return ModelInput(token_ids=ids, positions=pos, slots=torch.arange(n).repeat_interleave(t), segments=segs,
                          logit_rows=torch.arange(n * t))

    configs = [(n, t) for n in sessions for t in tokens]
    attn_check = check_attention(torch, device, dtype, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim)
    print(f"[bench] attention against the float32 reference, {attn_check['what']}: padded {attn_check['sdpa']:.1e}, "
          f"per-segment {attn_check['segments']:.1e} (relative)", flush=True)
    if not attn_check["sdpa"] <= 2 * attn_check["segments"] + 1e-3:
        print("[bench] the padded attention is off the reference: stopping", file=sys.stderr)
        return 1
    checks = {}
    for n, t in configs:
        inp = batch(n, t)
        a, b = runners["sdpa"].forward(inp), runners["segments"].forward(inp)
        rel = float((a - b).float().norm() / b.float().norm())
        same = float((a.argmax(-1) == b.argmax(-1)).float().mean())
        if not torch.isfinite(a).all() or rel > 5e-2:
            print(f"[bench] the padded path differs from the per-segment one at {n}x{t}: relative {rel:.2e}",
                  file=sys.stderr)
            return 1
        checks[(n, t)] = (rel, same)
    times: dict[tuple[int, int, str], list[float]] = {(n, t, m): [] for n, t in configs for m in runners}
    order = [(r, n, t, m) for r in range(args.rounds) for n, t in configs
             for m in (("segments", "sdpa") if r % 2 == 0 else ("sdpa", "segments"))]
    for _, n, t, m in tqdm(order, desc="step", unit="config"):
        inp, run = batch(n, t), runners[m]
        for _ in range(3):
            run.forward(inp)
        for _ in range(args.steps):
            sync(torch, device)
            t0 = time.perf_counter()
            run.forward(inp)
            sync(torch, device)
            times[(n, t, m)].append(time.perf_counter() - t0)

    # The default path with a new context length every step: the runner's kernels, and cuDNN's in the choice too.
    # Each step of a configuration gets a context no step of it had before, in either variant.
    runner = runners["sdpa"]
    shipped = list(runner.sdpa_backends)
    variants = {"shipped": shipped, "cudnn": shipped + [torch.nn.attention.SDPBackend.CUDNN_ATTENTION]}
    new_shape: dict[tuple[int, int, str], list[float]] = {(n, t, v): [] for n, t in configs for v in variants}
    order = [(r, n, t, v) for r in range(args.rounds) for n, t in configs
             for v in (("shipped", "cudnn") if r % 2 == 0 else ("cudnn", "shipped"))]
    fresh = {(n, t): iter(range(1, growing + 1)) for n, t in configs}
    for _, n, t, v in tqdm(order, desc="new context each step", unit="config"):
        runner.sdpa_backends = variants[v]
        for _ in range(args.growing_steps):
            inp = batch(n, t, next(fresh[(n, t)]))
            sync(torch, device)
            t0 = time.perf_counter()
            runner.forward(inp)
            sync(torch, device)
            new_shape[(n, t, v)].append(time.perf_counter() - t0)
    runner.sdpa_backends = shipped

    rows, lines = [], ["| sessions | tokens each | per-segment ms | padded ms | speed-up | floor ms | "
                       "padded / floor | relative difference | same greedy token | new context each step ms | "
                       "same, cuDNN in the choice ms |",
                       "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n, t in configs:
        seg_ms = statistics.median(times[(n, t, "segments")]) * 1000
        pad_ms = statistics.median(times[(n, t, "sdpa")]) * 1000
        grow_ms = statistics.median(new_shape[(n, t, "shipped")]) * 1000
        cudnn_ms = statistics.median(new_shape[(n, t, "cudnn")]) * 1000
        rel, same = checks[(n, t)]
        rows.append({"sessions": n, "tokens": t, "segments_ms": seg_ms, "sdpa_ms": pad_ms, "floor_ms": floor_ms,
                     "relative_difference": rel, "same_greedy": same, "new_context_ms": grow_ms,
                     "new_context_cudnn_ms": cudnn_ms})
        lines.append(f"| {n} | {t} | {seg_ms:.2f} | {pad_ms:.2f} | {seg_ms / pad_ms:.2f}x | {floor_ms:.2f} | "
                     f"{pad_ms / floor_ms:.1f}x | {rel:.1e} | {same:.1%} | {grow_ms:.2f} | {cudnn_ms:.2f} |")
    gpu = gpu_name() if device.type == "cuda" else None
    section = (
        f"{MARKER}\n\n"
        f"- date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}\n"
        f"- machine: {machine()}" + (f", GPU: {gpu}" if gpu else " (no GPU)") + f"; torch {torch.__version__}\n"
        f"- command: `python scripts/bench_gpu_step.py {' '.join(sys.argv[1:])}`\n"
        f"- target: {target.name}, {dtype}; every session holds {args.context} cached tokens; the step is "
        "`ModelRunner.forward` with logits for every new token, host time to the logits (synchronized), the median "
        f"of {args.steps} x {args.rounds} steps, the two paths interleaved round by round\n"
        f"- floor: {weight_bytes / 1e9:.2f} GB of weights / {bandwidth / 1e9:.0f} GB/s (device copy, read + write) "
        f"= {floor_ms:.2f} ms\n"
        "- per-segment: one attention call per session and layer (`--attention segments`); padded: the step's short "
        "segments in one call per layer (`sdpa`, the default); relative difference and greedy agreement of the two "
        "paths' logits on the same inputs\n"
        f"- attention alone against the float32 reference ({attn_check['what']}, NaN in every cache position past "
        f"a context): padded {attn_check['sdpa']:.1e}, per-segment {attn_check['segments']:.1e} relative error\n"
        f"- new context each step: the padded path, {args.growing_steps} x {args.rounds} steps per configuration "
        "whose cached context is one token longer every step (as in decoding: every step a new attention shape), "
        "median; with the runner's kernels (flash, efficient, math), and with cuDNN's in PyTorch's choice as well "
        "(its default), the two interleaved round by round\n\n"
        + "\n".join(lines) + "\n")
    publish(args.markdown, MARKER, section, args.json, rows)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
