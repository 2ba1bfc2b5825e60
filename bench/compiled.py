"""The compiled step beside eager PyTorch and the fused C step, per family, over the paged pool.

    sled-bench compiled --families llama,qwen3 --sizes 1x1,8x5,32x5 --context 512

Each family is a random-weight model of one shape (--layers, --hidden; the families' own differences: Qwen2's
biases, Qwen3's q/k norms, Gemma 3's norms and sliding layers, Mistral's window) on this CPU in float32. A size
NxT is N sessions verifying T tokens each over --context cached tokens, every session in blocks of its own. The
runners share one pool and take the same steps, interleaved round by round: `eager` (PyTorch, the server's default
path), `fused` (the C step) and `compiled` (verify_server/compiled.py, every bucket the sizes need compiled
first; the compile time is reported). The logits of the three are checked against eager's first.
Beside them, the step's projections alone (every linear layer's, the LM head's at every row, over eager's weights):
a step whose every other op took no time, so eager over it bounds what compiling the rest can gain. And a floor (a
roofline): the larger of the step's projections (every linear layer's multiply-adds, the logits' among them) at this
CPU's measured float32 matrix-product peak and its bytes (the weights and the sessions' KV, each read once) at the
measured copy bandwidth, as `sled-bench engine` sets its batch-1 floor.
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

from .cli import positive
from .report import copy_bandwidth, machine, publish

ROOT = Path(__file__).resolve().parent.parent
MARKER = "## Compiled step beside eager and fused (CPU)"
FAMILIES = ("llama", "qwen2", "qwen3", "gemma3_text", "mistral")


def _sizes(text: str) -> list[tuple[int, int]]:
    try:
        out = [tuple(int(x) for x in part.lower().split("x")) for part in text.split(",") if part.strip()]
    except ValueError:
        out = []
    if not out or any(len(s) != 2 or min(s) < 1 for s in out):
        raise argparse.ArgumentTypeError(f"sizes are SESSIONSxTOKENS, comma-separated (1x1,8x5), got {text!r}")
    return out


def _families(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    if not kinds or any(k not in FAMILIES for k in kinds):
        raise argparse.ArgumentTypeError(f"families are {', '.join(FAMILIES)}, got {text!r}")
    return kinds


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", type=_families, default=list(FAMILIES), help=f"default {','.join(FAMILIES)}")
    p.add_argument("--sizes", type=_sizes, default=_sizes("1x1,8x5,32x5"), help="default 1x1,8x5,32x5")
    p.add_argument("--context", type=positive(int), default=512, help="cached tokens a session (default 512)")
    p.add_argument("--layers", type=positive(int), default=8, help="layers of each model (default 8)")
    p.add_argument("--hidden", type=positive(int), default=576, help="hidden size; heads of 64 (default 576)")
    p.add_argument("--steps", type=positive(int), default=10, help="timed steps per runner per round (default 10)")
    p.add_argument("--rounds", type=positive(int), default=3, help="rounds, runners interleaved (default 3)")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    p.add_argument("--markdown", default=str(ROOT / "docs" / "benchmarks.md"), help="file whose section is rewritten")
    return p


def model_of(kind: str, layers: int, hidden: int):
    """A random-weight model of the family at the shape, stabilized as the random targets are."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from verify_server.model_loader import stabilize

    heads = hidden // 64
    extra = {"gemma3_text": dict(query_pre_attn_scalar=64, sliding_window=128,
                                 layer_types=["sliding_attention" if (i + 1) % 6 else "full_attention"
                                              for i in range(layers)]),
             "mistral": dict(sliding_window=256)}.get(kind, {})
    config = AutoConfig.for_model(kind, vocab_size=49152, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                                  num_hidden_layers=layers, num_attention_heads=heads,
                                  num_key_value_heads=max(1, heads // 3), head_dim=64, tie_word_embeddings=True,
                                  max_position_embeddings=4096, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    if kind != "gemma3_text":
        stabilize(model)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def matmul_peak() -> float:
    """This CPU's float32 matrix-product rate (flop/s): the best of a few square products of 2048."""
    import torch

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * 2048 ** 3 / best


class Projections:
    """A step's projections alone, through the runner's own: each layer's (q, k, v), o, (gate, up) and down, and the
    LM head at every logit row, over inputs of the step's rows (made once a size, outside the timing)."""

    def __init__(self, runner):
        self.runner = runner
        self.inputs = {}

    def rows(self, n: int, width: int):
        import torch

        if (n, width) not in self.inputs:
            self.inputs[(n, width)] = torch.randn(n, width, generator=torch.Generator().manual_seed(width),
                                                  dtype=self.runner.dtype)
        return self.inputs[(n, width)]

    def forward(self, inp) -> None:
        r, n = self.runner, inp.token_ids.shape[0]
        for layer, groups in zip(r.layers, r.proj):
            a, m = layer.self_attn, layer.mlp
            for project, first in zip(groups, (a.q_proj, a.o_proj, m.gate_proj, m.down_proj)):
                project(self.rows(n, first.in_features))
        r.head(self.rows(inp.logit_rows.shape[0], r.lm_head.shape[1]))


def run_family(kind: str, args, peaks: list[float], bandwidths: list[float]) -> tuple[list[dict], dict]:
    import torch

    from kernels.attention import Segment
    from verify_server.compiled import CompiledStep
    from verify_server.kv_cache import KVCache, KVLayout
    from verify_server.model_runner import ModelInput, ModelRunner

    model = model_of(kind, args.layers, args.hidden)
    cfg = model.config
    most = max(n for n, _ in args.sizes)
    longest = max(t for _, t in args.sizes)
    seq = args.context + longest
    kv = KVCache.create(KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, 64), most * (seq + 16), 16, seq)
    tables = [tuple(kv.blocks.allocate(kv.blocks_for(seq))) for _ in range(most)]
    g = torch.Generator().manual_seed(1)
    kv.k.normal_(generator=g).mul_(0.5)
    kv.v.normal_(generator=g).mul_(0.5)
    runners = {"eager": ModelRunner(model, kv, fused="off")}
    fused = ModelRunner(model, kv, fused="auto", fused_max_tokens=1 << 20)
    if fused.fused is not None:
        runners["fused"] = fused
    compiled = ModelRunner(model, kv, fused="off")
    compiled.compiled = CompiledStep(compiled, max(n * t for n, t in args.sizes))
    runners["compiled"] = compiled

    def batch(n: int, t: int) -> ModelInput:
        ids = torch.randint(3, cfg.vocab_size, (n * t,), generator=torch.Generator().manual_seed(n * 100 + t))
        segs = [Segment(tables[s], s * t, t, args.context + t, 16) for s in range(n)]
        return ModelInput.build(ids.tolist(), segs, list(range(n * t)))

    inputs = {size: batch(*size) for size in args.sizes}
    t0 = time.monotonic()
    for size, inp in inputs.items():  # compiles each bucket the sizes need
        compiled.forward(inp)
    compile_s = time.monotonic() - t0
    print(f"[bench] {kind}: compiled {sorted(compiled.compiled.compiled)} in {compile_s:.0f}s", flush=True)
    worst = 0.0
    for inp in inputs.values():
        want = runners["eager"].forward(inp)
        for name, runner in runners.items():
            worst = max(worst, (runner.forward(inp) - want).abs().max().item())
    timed = {**runners, "projections": Projections(runners["eager"])}
    times = {(name, size): [] for name in timed for size in args.sizes}
    for _ in range(args.rounds):
        for size, inp in inputs.items():
            for name, runner in timed.items():
                runner.forward(inp)
                for _ in range(args.steps):
                    t1 = time.perf_counter()
                    runner.forward(inp)
                    times[(name, size)].append(time.perf_counter() - t1)
        peaks.append(matmul_peak())  # between rounds too: the host's speed drifts, and the floor takes its best
        bandwidths.append(copy_bandwidth())
    linears = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weights = sum(w.numel() for w in linears)
    weight_bytes = sum(w.numel() * w.element_size() for w in linears)
    layers, kv_heads, _, head_dim = kv.k.shape
    kv_token = 2 * layers * kv_heads * head_dim * kv.k.element_size()  # a token's K and V in every layer
    rows = []
    for size in args.sizes:
        p50 = {name: statistics.median(times[(name, size)]) * 1000 for name in timed}
        rows.append({"family": kind, "sessions": size[0], "tokens": size[1], "context": args.context,
                     "flop": 2 * weights * size[0] * size[1],  # the projections' (every token is a logit row here)
                     "bytes": weight_bytes + kv_token * size[0] * (args.context + size[1]),
                     **{f"{name}_ms": ms for name, ms in p50.items()},
                     "compiled_over_eager": p50["eager"] / p50["compiled"],
                     "eager_over_projections": p50["eager"] / p50["projections"],
                     "compiled_over_fused": p50["fused"] / p50["compiled"] if "fused" in p50 else None,
                     # what the runner gains over eager where it keeps the faster of its fused and compiled steps
                     "eager_over_best": p50["eager"] / min(p50[name] for name in ("fused", "compiled") if name in p50)})
    for row in rows:
        row.update(compile_s=compile_s, max_logit_difference=worst)
    return rows, {"family": kind, "compile_s": compile_s, "max_logit_difference": worst}


def best_lines(rows: list[dict]) -> list[str]:
    """A line a size: eager over the faster of the fused and compiled steps, family by family."""
    sizes = dict.fromkeys((r["sessions"], r["tokens"]) for r in rows)
    return [f"- {n} × {t}, eager over the faster of the fused and compiled steps: "
            + ", ".join(f"{r['family']} {r['eager_over_best']:.2f}x" for r in rows
                        if (r["sessions"], r["tokens"]) == (n, t))
            for n, t in sizes]


def main(args) -> int:
    import torch

    rows, meta = [], []
    peaks, bandwidths = [matmul_peak()], [copy_bandwidth()]
    for kind in args.families:
        got, info = run_family(kind, args, peaks, bandwidths)
        rows += got
        meta.append(info)
    peak, bandwidth = max(peaks), max(bandwidths)
    print(f"[bench] float32 matrix products at {peak / 1e9:.0f} GFLOP/s, copies at {bandwidth / 1e9:.1f} GB/s here "
          f"(best of {len(peaks)} measures)", flush=True)
    for r in rows:
        compute_s, memory_s = r["flop"] / peak, r["bytes"] / bandwidth
        r.update(flop_per_s=peak, copy_bytes_per_s=bandwidth, floor_ms=max(compute_s, memory_s) * 1000,
                 floor_bound="compute" if compute_s >= memory_s else "memory")
        r["eager_over_floor"] = r["eager_ms"] / r["floor_ms"]
    lines = ["| family | sessions × tokens | eager ms | fused ms | compiled ms | eager / compiled | "
             "fused / compiled | projections ms | eager / projections | floor ms | eager / floor |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        fused = f"{r['fused_ms']:.1f}" if "fused_ms" in r else "—"
        over_fused = f"{r['compiled_over_fused']:.2f}x" if r["compiled_over_fused"] else "—"
        lines.append(f"| {r['family']} | {r['sessions']} × {r['tokens']} | {r['eager_ms']:.1f} | {fused} | "
                     f"{r['compiled_ms']:.1f} | {r['compiled_over_eager']:.2f}x | {over_fused} | "
                     f"{r['projections_ms']:.1f} | {r['eager_over_projections']:.2f}x | "
                     f"{r['floor_ms']:.1f} ({r['floor_bound']}) | {r['eager_over_floor']:.2f}x |")
    compiles = ", ".join(f"{m['family']} {m['compile_s']:.0f} s" for m in meta)
    worst = max(m["max_logit_difference"] for m in meta)
    command = "sled-bench compiled " + shlex.join(sys.argv[2:])
    section = "\n".join([
        MARKER, "",
        f"`{command.strip()}` on {machine()}, {torch.get_num_threads()} torch threads, "
        f"{datetime.now(timezone.utc):%Y-%m-%d}.", "",
        f"Random-weight models of {args.layers} layers, hidden {args.hidden} (heads of 64), float32; each size is N "
        f"sessions verifying T tokens over {args.context} cached tokens. Step p50 in ms, the runners interleaved "
        f"over {args.rounds} rounds of {args.steps} steps. The compiled step's buckets compiled first ({compiles}); "
        f"the largest logit difference from eager was {worst:.1e}. Projections: the step's projections alone, "
        "through eager's packed weights (every linear layer's, and the LM head's at every row: every token is a "
        "logit row here), timed beside the runners; a step whose every other op took no time, so eager / "
        "projections is the most that compiling the rest could gain. The floor is a roofline, the larger of two "
        "times: the step's linear layers (the logits' too: every token is a logit row) at this CPU's float32 "
        "matrix-product rate, "
        f"{peak / 1e9:.0f} GFLOP/s (each measure the best of three products of 2048 x 2048), and the weights and "
        f"the sessions' KV read once at its copy bandwidth, {bandwidth / 1e9:.1f} GB/s (bytes read and written, "
        f"1 GiB buffers; as `sled-bench engine`); each the best of {len(peaks)} measures taken between rounds.",
        "", *lines, "", *best_lines(rows), ""])
    publish(args.markdown, MARKER, section, args.json, rows)
    return 0
