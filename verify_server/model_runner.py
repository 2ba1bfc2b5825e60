"""One forward pass of the target over a ragged batch of sessions, against the KV pool.

The runner reads the weights of a transformers model (no copy) of a supported
family and does its own forward so that every session attends over its own
block table in the paged pool. Families differ from Llama's block in a few places, read once from
the config into a Family and per-layer LayerSpecs: q/k norms, Gemma's norms and
activation, sliding-window layers with their own RoPE.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels.attention import ATTENTION, Segment
from kernels.cpu_step import CpuStep, CpuStepUnavailable, StepModel
from kernels.flex import PagedFlex
from kernels.linear import LINEAR, resolve_linear

from .kv_cache import KVCache

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInput:
    token_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    rows: torch.Tensor  # [num_tokens] int64, the pool row each token's key and value go to
    tables: torch.Tensor  # [num_tokens, width] int64, the block table of each token's session (padded with 0)
    segments: list[Segment]
    logit_rows: torch.Tensor  # [num_logit_rows] int64, flat indices whose logits are wanted

    @classmethod
    def build(cls, token_ids: list[int], segments: list[Segment], logit_rows: list[int]) -> ModelInput:
        """The input of `segments`' new tokens (each segment's at the positions that end at its context_len)."""
        positions, rows, tables = [], [], []
        width = max((len(seg.blocks) for seg in segments), default=1)
        for seg in segments:
            first, bs = seg.context_len - seg.length, seg.block_size
            positions.extend(range(first, seg.context_len))
            rows.extend(seg.blocks[p // bs] * bs + p % bs for p in range(first, seg.context_len))
            tables.extend([list(seg.blocks) + [0] * (width - len(seg.blocks))] * seg.length)
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
        return cls(as_long(token_ids), as_long(positions), as_long(rows),
                   as_long(tables).reshape(len(token_ids), width), segments, as_long(logit_rows))

    @classmethod
    def placeholder(cls, n: int, blocks: list[int], block_size: int) -> ModelInput:
        """n placeholder tokens (id 1) at positions [0, n) of a session holding `blocks`, every row's logits: for
        warm-up and timing."""
        return cls.build([1] * n, [Segment(tuple(blocks), 0, n, n, block_size)], list(range(n)))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As transformers' LlamaRMSNorm: normalise in float32, cast back, then scale (one op in float32).
    if x.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    return F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype) * weight


def _gemma_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As transformers' Gemma3RMSNorm, with `weight` already 1 + w in float32: scale in float32, then cast.
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    # x * cos + rotate_half(x) * sin, where rotate_half(x) = cat(-x2, x1) = roll(x, half) * [-1.., +1..]:
    # the sign lives in sin_signed, so this is exact and two ops shorter.
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


# Query rows a FlexAttention call is padded to: each size compiles once, so a few, as vLLM and SGLang pad their
# verify batches of K + 1 tokens a session; past the last, whole multiples of it.
FLEX_BUCKETS = (8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def flex_length(n: int) -> int:
    for size in FLEX_BUCKETS:
        if n <= size:
            return size
    return -(-n // FLEX_BUCKETS[-1]) * FLEX_BUCKETS[-1]


def _check_segments(inp: ModelInput) -> None:
    """The fused step reads no segments: each token attends to positions [0, its own] of its block table. That is
    the segments' rule exactly when a segment's tokens sit at consecutive positions ending at its context length,
    with its table, which ModelInput.build always makes; anything else is refused rather than attended
    differently."""
    positions = inp.positions.tolist()
    covered = 0
    for seg in inp.segments:
        first = seg.context_len - seg.length
        tables = inp.tables[seg.start:seg.start + seg.length, :len(seg.blocks)]
        if (positions[seg.start:seg.start + seg.length] != list(range(first, seg.context_len))
                or not bool((tables == torch.tensor(seg.blocks, dtype=torch.long)).all())):
            raise ValueError(f"segment {seg} does not match its tokens' positions and block tables")
        covered += seg.length
    if covered != len(positions):
        raise ValueError(f"segments cover {covered} tokens of {len(positions)}")


# transformers model_type -> the family's differences from Llama's block.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


def check_architecture(config) -> None:
    """Refuse a target the runner cannot compute, naming it and what is supported."""
    name = getattr(config, "model_type", None)
    if name not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported target architecture {name!r}: SLED serves "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")


@dataclass(frozen=True)
class Family:
    """How a family's block differs from Llama's."""

    qk_norm: bool  # an RMSNorm over each head's q and k before RoPE (Qwen3, Gemma 3)
    gemma: bool  # Gemma: norms scale by 1 + w in float32, norms after attention and around the MLP, tanh GELU,
    # embeddings scaled by sqrt(hidden), attention scaled by query_pre_attn_scalar

    @classmethod
    def of(cls, config) -> Family:
        check_architecture(config)
        kind = config.model_type
        return cls(qk_norm=kind in ("qwen3", "gemma3_text"), gemma=kind == "gemma3_text")


@dataclass(frozen=True)
class LayerSpec:
    """What one layer reads besides its projections: its norm weights (None where the family has none there),
    its sliding window (None: global attention) and which RoPE table it rotates with."""

    pre_attention: torch.Tensor
    pre_mlp: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_attention: torch.Tensor | None
    post_mlp: torch.Tensor | None
    window: int | None
    rope: str


def _inv_freq(rope: dict, head_dim: int) -> torch.Tensor:
    """RoPE's inverse frequencies for one rope_parameters dict: default, or linear (positions divided by factor)."""
    kind = rope.get("rope_type") or "default"
    if kind not in ("default", "linear"):
        raise ValueError(f"unsupported rope type {kind!r} (SLED computes default and linear RoPE)")
    inv = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    return inv / rope["factor"] if kind == "linear" else inv


def _layer_windows_and_ropes(cfg) -> tuple[list[int | None], list[str], dict[str, dict]]:
    """Per layer its sliding window and RoPE name; the RoPE parameters by name. Layer types come from the config's
    layer_types (Gemma 3, Qwen2/3); Mistral slides every layer by its sliding_window."""
    n = cfg.num_hidden_layers
    types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * n)
    window = getattr(cfg, "sliding_window", None)
    if cfg.model_type == "mistral" and window is not None:
        types = ["sliding_attention"] * n
    windows = [window if t == "sliding_attention" else None for t in types]
    rope = getattr(cfg, "rope_parameters", None) or {}
    if all(t in rope for t in set(types)):  # one RoPE per layer type (Gemma 3)
        return windows, types, {t: dict(rope[t]) for t in set(types)}
    flat = {"rope_type": rope.get("rope_type", "default"),
            "rope_theta": rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)), **rope}
    return windows, ["all"] * n, {"all": flat}


# The attention kernels PyTorch may choose from on CUDA: not cuDNN's, which costs host time at every attention shape
# it has not met, and decoding meets a new one at nearly every step (docs/kernels.md). A runner's `sdpa_backends`.
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

# The fused step's threshold before calibrate_fused() runs, or where a runner is built without it.
UNCALIBRATED_FUSED_MAX_TOKENS = 8


class LayerKernels(NamedTuple):
    """How layers_forward computes: attention(q, k_cache, v_cache, segments, scale, plan), each layer's projections
    (as ModelRunner.proj) and each layer's (k, v) pool (None: views of the runner's KV pool)."""

    attention: Callable
    proj: list
    caches: list | None = None


@dataclass(frozen=True)
class CalibrationPlan:
    """What calibrate_fused() times: the sizes it bisects (up to a loaded server's largest steps), the pairs a size
    and how many more rounds of them a loss gets before it is believed."""

    sizes: tuple[int, ...] = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    repeats: int = 3
    confirm: int = 2


@dataclass(frozen=True)
class FusedCalibration:
    """calibrate_fused's outcome: the threshold it set, fused / PyTorch per size timed, and whether its time bound
    cut it short (a later start goes on from `ratios`)."""

    max_tokens: int
    ratios: dict[int, float]
    cut: bool


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: KVCache, attention: str = "sdpa", linear: str = "auto",
                 fused: str = "auto", fused_max_tokens: int | None = None, shard=None):
        """shard (tensor_parallel.Shard): the model's projections are this rank's shard (tensor_parallel.shard_model);
        each row-parallel projection's output is all-reduced, and only rank 0 computes logits."""
        cfg = model.config
        self.family = Family.of(cfg)
        self.shard = shard
        world = shard.world if shard is not None else 1
        self.reduce = shard.all_reduce if shard is not None and world > 1 else (lambda x: x)
        self.model = model
        self.kv = kv
        if attention == "flex":  # one compiled FlexAttention call per layer, over the pool in place
            self.flex = PagedFlex(kv.pool_shape(), max_tokens=max(FLEX_BUCKETS[-1], kv.max_seq_len))
            kv.zero_blocks = True
            self.prepare_attention = None
            self.attention = lambda q, k, v, segments, scale, plan: self.flex.attend(q, k, v, plan, scale)
        else:
            self.prepare_attention, self.attention = ATTENTION[attention]
        self.attention_name = attention
        self.num_heads = cfg.num_attention_heads // world  # this rank's heads
        self.num_kv_heads = cfg.num_key_value_heads // world
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        gemma = self.family.gemma
        self.scale = (cfg.query_pre_attn_scalar if gemma else self.head_dim) ** -0.5
        self.norm_fn = _gemma_norm if gemma else _rms_norm
        self.act = (lambda x: F.gelu(x, approximate="tanh")) if gemma else F.silu
        inner = model.model
        self.embed = inner.embed_tokens.weight
        self.device = self.embed.device
        self.dtype = self.embed.dtype
        # Gemma scales embeddings by sqrt(hidden), rounded to the weights' dtype as transformers does.
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5, dtype=self.dtype) if gemma else None
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None) if gemma else None
        self.layers = list(inner.layers)
        self.norm = self._norm_weight(inner.norm.weight)
        self.lm_head = model.lm_head.weight
        self.linear = resolve_linear(linear, self.device, self.dtype)
        make = LINEAR[self.linear]
        # Per layer: (q, k, v), o, (gate, up) and down, each group one projection reading one input.
        self.proj, self.project_logits = self.projections(make)
        windows, ropes, rope_params = _layer_windows_and_ropes(cfg)
        self.specs = [self._spec(layer, w, r) for layer, w, r in zip(self.layers, windows, ropes)]
        self.windows = sorted(set(windows), key=lambda w: (w is not None, w or 0))
        self.cos, self.sin_signed = {}, {}  # RoPE name -> [max_seq_len, head_dim]
        for name, params in rope_params.items():
            freqs = torch.outer(torch.arange(kv.max_seq_len, dtype=torch.float64), _inv_freq(params, self.head_dim))
            emb = torch.cat((freqs, freqs), dim=-1)
            self.cos[name] = emb.cos().to(device=self.device, dtype=self.dtype)
            sin = emb.sin()
            half = self.head_dim // 2
            self.sin_signed[name] = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(device=self.device,
                                                                                          dtype=self.dtype)
        # None: calibrate_fused() measures it (the engine's warm-up); until then, a threshold measured on one host.
        self.fused_max_tokens = fused_max_tokens if fused_max_tokens is not None else UNCALIBRATED_FUSED_MAX_TOKENS
        self.fused = self._make_fused(fused)
        self.compiled = None  # a CompiledStep (verify_server.compiled) takes the steps the fused one does not
        self.sdpa_backends = list(CUDA_SDPA_BACKENDS)  # the attention kernels PyTorch may choose from, on CUDA

    def projections(self, make: Callable) -> tuple[list[tuple], Callable]:
        """Per layer its (q, k, v), o, (gate, up) and down projections, and the logits projection, made by `make`
        (kernels.linear)."""
        proj = []
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            groups = ((a.q_proj, a.k_proj, a.v_proj), (a.o_proj,), (m.gate_proj, m.up_proj), (m.down_proj,))
            proj.append(tuple(make([mod.weight for mod in g], [mod.bias for mod in g]) for g in groups))
        return proj, make([self.lm_head], [getattr(self.model.lm_head, "bias", None)])

    def _norm_weight(self, w: torch.Tensor | None) -> torch.Tensor | None:
        # Gemma's norms scale by 1 + w in float32; computed once here rather than at every step.
        return None if w is None else (1.0 + w.float()) if self.family.gemma else w

    def _spec(self, layer, window: int | None, rope: str) -> LayerSpec:
        a, n = layer.self_attn, self._norm_weight
        q_norm, k_norm = (n(a.q_norm.weight), n(a.k_norm.weight)) if self.family.qk_norm else (None, None)
        if self.family.gemma:
            return LayerSpec(n(layer.input_layernorm.weight), n(layer.pre_feedforward_layernorm.weight), q_norm,
                             k_norm, n(layer.post_attention_layernorm.weight),
                             n(layer.post_feedforward_layernorm.weight), window, rope)
        return LayerSpec(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, q_norm, k_norm,
                         None, None, window, rope)

    def kernels(self) -> dict:
        """How this runner computes: device, dtype, attention and linear kernels, and the largest step (in tokens)
        the fused CPU step takes, 0 where it is not used. The server's Info carries it."""
        return {"device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                "attention": (f"{self.compiled.attention}, compiled" if self.compiled is not None
                              else self.attention_name),
                "linear": self.linear,
                "fused_max_tokens": self.fused_max_tokens if self.fused is not None else 0}

    def calibrate_fused(self, blocks: list[int], plan: CalibrationPlan = CalibrationPlan(), timer=None,
                        budget_s: float | None = None, clock=time.monotonic,
                        known: dict[int, float] | None = None) -> FusedCalibration:
        """Set fused_max_tokens where the fused step stops beating PyTorch on this machine: the largest of the plan's
        sizes at which one session's forward of that many tokens (positions from 0) is at least as fast fused, the
        two timed alternately `repeats` times (best of each); `blocks` is the block table it writes into, long enough
        for the largest size. The fused step wins small steps and PyTorch's GEMMs large ones, so the sizes are
        bisected: a win rules in every smaller size, a loss every larger one. A size PyTorch seems to win is timed
        `repeats` times more, up to `confirm` times, before that is believed (the best of all its timings): one
        disturbed stretch of a busy host must not send a loaded server's larger steps through PyTorch. No pair is
        begun that would end past `budget_s` seconds (by `clock`, as long as the size's last pair took): the
        calibration is then `cut`, and the threshold is the largest win so far, at least
        UNCALIBRATED_FUSED_MAX_TOKENS below any loss. `known`: the ratios of an earlier, cut calibration, not timed
        again. `timer(n, fused)`, for tests, replaces the measurement."""
        timer = timer or (lambda n, fused: self._time_forward(n, blocks, fused))
        deadline = clock() + budget_s if budget_s is not None else None
        late = lambda need: deadline is not None and clock() + need > deadline  # noqa: E731
        room = min(len(blocks) * self.kv.block_size, self.kv.max_seq_len)
        ratios = dict(known or {})
        cut = False
        while True:
            limit = min((n for n, r in ratios.items() if r > 1.0), default=float("inf"))
            best = max((n for n, r in ratios.items() if r <= 1.0 and n < limit), default=0)
            open_ = [n for n in plan.sizes if best < n < limit and n <= room]
            if not open_:
                break
            n = open_[len(open_) // 2]
            ratio = self._fused_ratio(n, timer, plan, late, clock)
            if ratio is None:  # a size not timed in full does not count
                cut = True
                break
            ratios[n] = ratio
        fallback = UNCALIBRATED_FUSED_MAX_TOKENS if limit > UNCALIBRATED_FUSED_MAX_TOKENS else 0
        self.fused_max_tokens = max(best, fallback) if cut else best
        return FusedCalibration(self.fused_max_tokens, dict(sorted(ratios.items())), cut)

    @staticmethod
    def _fused_ratio(n: int, timer, plan: CalibrationPlan, late, clock) -> float | None:
        """Fused / PyTorch at n tokens, best of each; a loss is timed again up to `plan.confirm` times. None: a
        pair would have ended late (`late(seconds of the last pair)`)."""
        times, pair_s = {True: [], False: []}, 0.0
        for _ in range(1 + plan.confirm):
            for _ in range(plan.repeats):
                if late(pair_s):
                    return None
                t0 = clock()
                for fused in (True, False):
                    times[fused].append(timer(n, fused))
                pair_s = clock() - t0
            ratio = min(times[True]) / min(times[False])
            if ratio <= 1.0:
                break
        return ratio

    def set_fused_max_tokens(self, n: int) -> None:
        """The fused step's threshold as an earlier calibration measured it (through any wrapper of the runner)."""
        self.fused_max_tokens = n

    def _time_forward(self, n: int, blocks: list[int], fused: bool) -> float:
        inp = ModelInput.placeholder(n, blocks, self.kv.block_size)
        keep = self.fused_max_tokens
        self.fused_max_tokens = n if fused else 0
        try:
            t0 = time.perf_counter()
            self.forward(inp)
            return time.perf_counter() - t0
        finally:
            self.fused_max_tokens = keep

    def _make_fused(self, mode: str) -> CpuStep | None:
        """`auto`: the fused CPU step where it builds and runs (float32 on CPU), else PyTorch; `on`: it or an
        error; `off`: PyTorch only."""
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"fused must be auto, on or off, got {mode!r}")
        if mode == "off" or (mode == "auto" and (self.device.type != "cpu" or self.dtype != torch.float32)):
            return None
        why = self._unfused_reason()
        if why:
            if mode == "on":
                raise ValueError(f"fused: on, but the fused CPU step cannot compute this target: {why}")
            log.info("the fused CPU step steps aside for this target (%s): PyTorch computes every batch", why)
            return None
        try:
            def bias(mod):
                return getattr(mod, "bias", None)
            layers = []
            for layer, spec in zip(self.layers, self.specs):  # the specs' norms: Gemma's already 1 + w
                a, m = layer.self_attn, layer.mlp
                layers.append({"ln1": spec.pre_attention, "ln2": spec.pre_mlp, "qn": spec.q_norm, "kn": spec.k_norm,
                               "pn1": spec.post_attention, "pn2": spec.post_mlp,
                               "q": a.q_proj.weight, "k": a.k_proj.weight, "v": a.v_proj.weight,
                               "bq": bias(a.q_proj), "bk": bias(a.k_proj), "bv": bias(a.v_proj),
                               "o": a.o_proj.weight, "bo": bias(a.o_proj), "gate": m.gate_proj.weight,
                               "up": m.up_proj.weight, "bgate": bias(m.gate_proj), "bup": bias(m.up_proj),
                               "down": m.down_proj.weight, "bdown": bias(m.down_proj),
                               "cos": self.cos[spec.rope], "sin_signed": self.sin_signed[spec.rope],
                               "window": spec.window})
            return CpuStep(StepModel(layers=layers, norm=self.norm, lm_head=self.lm_head,
                                     lm_bias=bias(self.model.lm_head), k_cache=self.kv.k, v_cache=self.kv.v,
                                     num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                     head_dim=self.head_dim, eps=self.eps, scale=self.scale,
                                     block_size=self.kv.block_size,
                                     activation="gelu_tanh" if self.family.gemma else "silu"))
        except CpuStepUnavailable as err:
            if mode == "on":
                raise ValueError(f"fused: on, but the fused CPU step is unavailable: {err}") from err
            log.warning("fused CPU step unavailable, using PyTorch for every batch: %s", err)
            return None

    def _unfused_reason(self) -> str | None:
        """Why the fused CPU step (every family's block, kernels.cpu_step) cannot compute this target."""
        if self.shard is not None and self.shard.world > 1:
            return "tensor parallel"
        return None

    @property
    def vocab_size(self) -> int:
        return self.lm_head.shape[0]

    @torch.inference_mode()
    def forward(self, inp: ModelInput) -> torch.Tensor:  # [num_logit_rows, vocab]
        n = inp.token_ids.shape[0]
        fused = self.fused is not None and n <= self.fused_max_tokens
        if self.compiled is not None and not fused and n <= self.compiled.buckets[-1]:
            return self.compiled.forward(inp)  # a step past the largest bucket (a calibration's) runs eager
        tokens = inp.token_ids.to(self.device)
        positions = inp.positions.to(self.device)
        h = self.embed_tokens(tokens)
        if fused:
            _check_segments(inp)
            return self.capped(self.fused(h, positions, inp.tables, inp.logit_rows))
        rows = inp.rows.to(self.device)
        if self.device.type == "cuda":
            with sdpa_kernel(self.sdpa_backends):
                return self._forward(inp, h, positions, rows)
        return self._forward(inp, h, positions, rows)

    def _forward(self, inp: ModelInput, h: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        groups = self.num_heads // self.num_kv_heads
        if self.prepare_attention is None:  # flex: one filling of its buffers for every window
            plans = self.flex.plans(inp.segments, self.windows, flex_length(inp.token_ids.shape[0]))
        else:
            plans = {w: self.prepare_attention(inp.segments, self.device, groups, self.dtype, w) for w in self.windows}
        h = self.layers_forward(h, positions, rows, inp.segments, plans)
        if self.shard is not None and self.shard.rank:
            return None  # rank 0 alone samples
        return self.logits(h, inp.logit_rows.to(self.device))

    def layers_forward(self, h: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, segments, plans: dict,
                       kernels: LayerKernels | None = None) -> torch.Tensor:
        """Every layer over the embedded tokens h: each token's key and value written to its pool row, then
        attention with the plan of its layer's window. Traceable whole (segments None) for the compiled step,
        which brings its own kernels (attention, projections, each layer's (k, v) pool as its own input); by
        default the runner's."""
        attention, proj, caches = kernels or LayerKernels(self.attention, self.proj)
        n, norm = h.shape[0], self.norm_fn
        cos = {name: table[positions].unsqueeze(1) for name, table in self.cos.items()}  # [num_tokens, 1, head_dim]
        sin = {name: table[positions].unsqueeze(1) for name, table in self.sin_signed.items()}
        for i, spec in enumerate(self.specs):
            qkv_proj, o_proj, gate_up_proj, down_proj = proj[i]
            q, k, v = qkv_proj(norm(h, spec.pre_attention, self.eps))
            q = q.view(n, self.num_heads, self.head_dim)
            k = k.view(n, self.num_kv_heads, self.head_dim)
            v = v.view(n, self.num_kv_heads, self.head_dim)
            if spec.q_norm is not None:
                q, k = norm(q, spec.q_norm, self.eps), norm(k, spec.k_norm, self.eps)
            q = _rope(q, cos[spec.rope], sin[spec.rope])
            k = _rope(k, cos[spec.rope], sin[spec.rope])
            k_cache, v_cache = caches[i] if caches else (self.kv.k[i], self.kv.v[i])  # [kv_heads, pool_rows, d]
            k_cache[:, rows] = k.transpose(0, 1)
            v_cache[:, rows] = v.transpose(0, 1)
            o = attention(q, k_cache, v_cache, segments, self.scale, plans[spec.window])
            h = h + _maybe(norm, self.reduce(o_proj(o.reshape(n, -1))[0]), spec.post_attention, self.eps)
            gate, up = gate_up_proj(norm(h, spec.pre_mlp, self.eps))
            h = h + _maybe(norm, self.reduce(down_proj(self.act(gate) * up)[0]), spec.post_mlp, self.eps)
        return h

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        h = F.embedding(tokens, self.embed)  # [num_tokens, hidden]
        return h * self.embed_scale if self.embed_scale is not None else h

    def logits(self, h: torch.Tensor, rows: torch.Tensor, project=None) -> torch.Tensor:
        """The float32 logits of the hidden states at `rows`."""
        return self.head(self.final_norm(h, rows), project)

    def final_norm(self, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return self.norm_fn(h[rows], self.norm, self.eps)

    def head(self, normed: torch.Tensor, project=None) -> torch.Tensor:
        """The float32 logits of final-normed hidden states."""
        return self.capped((project or self.project_logits)(normed)[0].float())

    def capped(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits under the family's final soft cap (Gemma's, where its config sets one)."""
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


def _maybe(norm: Callable, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return x if weight is None else norm(x, weight, eps)
