"""The target's step on a GPU: a batch of sessions, per-segment attention against one padded call per layer.

    sled-bench gpu-step --target random:llama-1b --tokenizer runs/tokenizer

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
import shlex
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from .cli import counts_arg, positive
from .report import copy_bandwidth, gpu_name, machine, publish

ROOT = Path(__file__).resolve().parent.parent
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
        segments.append(Segment((slot,), start, length, context, 1024))  # one block of 1024 positions each
        start += length
    k = torch.randn(kv_heads, len(shape) * 1024, head_dim, generator=g, device=device)
    v = torch.randn(kv_heads, len(shape) * 1024, head_dim, generator=g, device=device)
    q = torch.randn(start, heads, head_dim, generator=g, device=device)
    want = attention_reference(q, k, v, segments, head_dim ** -0.5).float()
    for seg in segments:
        k.view(kv_heads, len(shape), 1024, head_dim)[:, seg.blocks[0], seg.context_len:] = float("nan")
        v.view(kv_heads, len(shape), 1024, head_dim)[:, seg.blocks[0], seg.context_len:] = float("nan")
    errors = {"what": f"{len(segments)} segments of 1-40 tokens over 60-911 keys, {dtype}"}
    for name in ("sdpa", "segments"):
        prepare, attend = ATTENTION[name]
        qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
        out = attend(qd, kd, vd, segments, head_dim ** -0.5, prepare(segments, device, heads // kv_heads, dtype))
        err = float((out.float() - want).norm() / want.norm())
        errors[name] = err if torch.isfinite(out).all() else float("inf")
    return errors


class Setup:
    """The target, a KV pool of sessions holding --context cached tokens, and the two attention paths' runners."""

    def __init__(self, args):
        import torch

        from verify_server.kv_cache import KVCache, KVLayout
        from verify_server.model_loader import load_target, resolve_device, resolve_dtype
        from verify_server.model_runner import ModelRunner

        self.args = args
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        print(f"[bench] building {args.target} on {self.device} ({self.dtype}) ...", flush=True)
        self.target = load_target(args.target, self.device, self.dtype, args.tokenizer)
        cfg = self.cfg = self.target.model.config
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.growing = 2 * args.rounds * args.growing_steps  # distinct contexts per configuration, both variants
        seq = args.context + self.growing + max(args.tokens) + 1
        # One block of seq positions per session: each reads its keys as one view.
        kv = KVCache(KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, self.head_dim, self.dtype, self.device),
                     max(args.sessions), seq, seq)
        self.seq = seq
        g = torch.Generator(device=self.device).manual_seed(0)
        # Cached keys and values of the scale a real forward writes; positions past the context stay unwritten.
        per_session = (cfg.num_hidden_layers, cfg.num_key_value_heads, max(args.sessions), seq, self.head_dim)
        kv.k.view(per_session)[..., :args.context, :].normal_(generator=g).mul_(0.5)
        kv.v.view(per_session)[..., :args.context, :].normal_(generator=g).mul_(0.5)
        self.runners = {name: ModelRunner(self.target.model, kv, name, fused="off") for name in ("segments", "sdpa")}
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.target.model.parameters())
        self.bandwidth = copy_bandwidth(repeats=10, device=self.device)
        self.configs = [(n, t) for n in args.sessions for t in args.tokens]

    def batch(self, n: int, t: int, extra: int = 0):
        """n sessions of t new tokens each, over --context + extra cached tokens."""
        import torch

        from kernels.attention import Segment
        from verify_server.model_runner import ModelInput

        ctx = self.args.context + extra
        segs = [Segment((s,), s * t, t, ctx + t, self.seq) for s in range(n)]
        ids = torch.randint(0, self.target.vocab_size, (n * t,), generator=torch.Generator().manual_seed(n * 100 + t))
        return ModelInput.build(ids.tolist(), segs, list(range(n * t)))

    def timed(self, runner, inp) -> float:
        import torch

        sync(torch, self.device)
        t0 = time.perf_counter()
        runner.forward(inp)
        sync(torch, self.device)
        return time.perf_counter() - t0


def agreement(setup: Setup) -> dict | None:
    """The padded path against the per-segment one on the same inputs (relative difference, same greedy token), or
    None (after saying why) where either is off."""
    import torch

    checks = {}
    for n, t in setup.configs:
        inp = setup.batch(n, t)
        a, b = setup.runners["sdpa"].forward(inp), setup.runners["segments"].forward(inp)
        rel = float((a - b).float().norm() / b.float().norm())
        if not torch.isfinite(a).all() or rel > 5e-2:
            print(f"[bench] the padded path differs from the per-segment one at {n}x{t}: relative {rel:.2e}",
                  file=sys.stderr)
            return None
        checks[(n, t)] = (rel, float((a.argmax(-1) == b.argmax(-1)).float().mean()))
    return checks


def time_paths(setup: Setup) -> dict:
    """Each configuration through both paths, interleaved round by round."""
    from tqdm import tqdm

    args = setup.args
    times = {(n, t, m): [] for n, t in setup.configs for m in setup.runners}
    order = [(r, n, t, m) for r in range(args.rounds) for n, t in setup.configs
             for m in (("segments", "sdpa") if r % 2 == 0 else ("sdpa", "segments"))]
    for _, n, t, m in tqdm(order, desc="step", unit="config"):
        inp, run = setup.batch(n, t), setup.runners[m]
        for _ in range(3):
            run.forward(inp)
        times[(n, t, m)] += [setup.timed(run, inp) for _ in range(args.steps)]
    return times


def time_new_contexts(setup: Setup) -> dict:
    """The default path with a context no step had before at every step (as in decoding): with the runner's
    attention kernels, and with cuDNN's in PyTorch's choice as well, interleaved round by round."""
    import torch
    from tqdm import tqdm

    args, runner = setup.args, setup.runners["sdpa"]
    shipped = list(runner.sdpa_backends)
    variants = {"shipped": shipped, "cudnn": shipped + [torch.nn.attention.SDPBackend.CUDNN_ATTENTION]}
    times = {(n, t, v): [] for n, t in setup.configs for v in variants}
    order = [(r, n, t, v) for r in range(args.rounds) for n, t in setup.configs
             for v in (("shipped", "cudnn") if r % 2 == 0 else ("cudnn", "shipped"))]
    fresh = {(n, t): iter(range(1, setup.growing + 1)) for n, t in setup.configs}
    for _, n, t, v in tqdm(order, desc="new context each step", unit="config"):
        runner.sdpa_backends = variants[v]
        times[(n, t, v)] += [setup.timed(runner, setup.batch(n, t, next(fresh[(n, t)])))
                             for _ in range(args.growing_steps)]
    runner.sdpa_backends = shipped
    return times


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="random:llama-1b", help="target spec (default random:llama-1b)")
    p.add_argument("--tokenizer", metavar="DIR", help="tokenizer folder for the random target (export_tokenizer.py)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda (default auto)")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16")
    p.add_argument("--sessions", type=counts_arg, default=counts_arg("1,4,16,32"), help="session counts (default "
                                                                                       "1,4,16,32)")
    p.add_argument("--tokens", type=counts_arg, default=counts_arg("1,9"), help="new tokens a session (default 1,9)")
    p.add_argument("--context", type=positive(int), default=256, help="cached tokens a session (default 256)")
    p.add_argument("--steps", type=positive(int), default=30, help="timed forwards a configuration a round (default 30)")
    p.add_argument("--rounds", type=positive(int), default=3, help="rounds, the two paths interleaved (default 3)")
    p.add_argument("--growing-steps", type=positive(int), default=10,
                   help="timed forwards a round with a context one longer every step (default 10)")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    p.add_argument("--markdown", default=str(ROOT / "docs" / "benchmarks.md"), help="file whose section is rewritten")
    return p


def main(args) -> int:
    import torch

    setup = Setup(args)
    attn = check_attention(torch, setup.device, setup.dtype, setup.cfg.num_attention_heads,
                           setup.cfg.num_key_value_heads, setup.head_dim)
    print(f"[bench] attention against the float32 reference, {attn['what']}: padded {attn['sdpa']:.1e}, "
          f"per-segment {attn['segments']:.1e} (relative)", flush=True)
    checks = agreement(setup) if attn["sdpa"] <= 2 * attn["segments"] + 1e-3 else None
    if checks is None:
        print("[bench] the padded attention is off the reference: stopping", file=sys.stderr)
        return 1
    times, new_shape = time_paths(setup), time_new_contexts(setup)
    floor_ms = setup.weight_bytes / setup.bandwidth * 1000
    rows, lines = [], ["| sessions | tokens each | per-segment ms | padded ms | speed-up | floor ms | padded / floor | "
                       "relative difference | same greedy token | new context each step ms | same, cuDNN in the "
                       "choice ms |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n, t in setup.configs:
        seg, pad, grow, cudnn = (statistics.median(d[key]) * 1000 for d, key in (
            (times, (n, t, "segments")), (times, (n, t, "sdpa")), (new_shape, (n, t, "shipped")),
            (new_shape, (n, t, "cudnn"))))
        rel, same = checks[(n, t)]
        rows.append({"sessions": n, "tokens": t, "segments_ms": seg, "sdpa_ms": pad, "floor_ms": floor_ms,
                     "relative_difference": rel, "same_greedy": same, "new_context_ms": grow,
                     "new_context_cudnn_ms": cudnn})
        lines.append(f"| {n} | {t} | {seg:.2f} | {pad:.2f} | {seg / pad:.2f}x | {floor_ms:.2f} | {pad / floor_ms:.1f}x "
                     f"| {rel:.1e} | {same:.1%} | {grow:.2f} | {cudnn:.2f} |")
    gpu = gpu_name() if setup.device.type == "cuda" else None
    section = (
        f"{MARKER}\n\n`sled-bench gpu-step {shlex.join(sys.argv[2:])}` on {machine()}"
        + (f", GPU {gpu}" if gpu else " (no GPU)") + f", torch {torch.__version__}, "
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}.\n\n"
        f"- target: {setup.target.name}, {setup.dtype}; every session holds {args.context} cached tokens; the step is "
        "`ModelRunner.forward` with logits for every new token, host time to the logits (synchronized), the median "
        f"of {args.steps} × {args.rounds} steps, the two paths interleaved\n"
        f"- floor: {setup.weight_bytes / 1e9:.2f} GB of weights / {setup.bandwidth / 1e9:.0f} GB/s (device copy, "
        f"read + write) = {floor_ms:.2f} ms\n"
        "- per-segment: one attention call per session and layer (`--attention segments`); padded: the short "
        "segments of a step in one call per layer (`sdpa`, the default)\n"
        f"- attention alone against the float32 reference ({attn['what']}, NaN past every context): padded "
        f"{attn['sdpa']:.1e}, per-segment {attn['segments']:.1e} relative error\n"
        "- new context each step: the padded path with a context one token longer every step (as in decoding), with "
        "the runner's kernels, and with cuDNN's in PyTorch's choice as well (its default)\n\n"
        + "\n".join(lines) + "\n")
    publish(args.markdown, MARKER, section, args.json, rows)
    print("\n".join(lines))
    return 0
