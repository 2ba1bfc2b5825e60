"""The target's forward for a few tokens in one C call (float32, CPU): build, load and bind kernels/cpu_step.c.

The library is compiled at first use with the system C compiler (`$CC`, else `cc`) for the CPU it runs on
(`-O3 -march=native -fopenmp`) and kept in a cache directory under a name made from the source, the compiler
and the CPU, so a second process (or a second test) loads it in milliseconds. Where no compiler works,
`load_library` raises `CpuStepUnavailable` with the compiler's message and callers keep PyTorch's path.

It links the OpenMP runtime by its usual name (libgomp.so.1), the name PyTorch's own copy carries, so
loaded after torch it shares torch's thread pool instead of starting a second one on the same cores.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_step.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]


class CpuStepUnavailable(RuntimeError):
    """The fused CPU step cannot run here (no compiler, a failed build, an unsupported model or dtype)."""


def _cpuinfo(*keys: str) -> str:
    """The first line of /proc/cpuinfo that starts with one of `keys` ('' where there is none or no such file)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(keys):
                return line
    except OSError:
        pass
    return ""


def _cpu_id() -> str:
    return _cpuinfo("flags", "Features") or platform.processor()


def machine_id() -> str:
    """This machine as measurements made on it depend on: architecture, CPU model, cores and instruction set."""
    flags = hashlib.sha256(_cpu_id().encode()).hexdigest()[:12]
    model = _cpuinfo("model name").partition(":")[2].strip() or platform.processor()
    return f"{platform.machine()} {model}, {os.cpu_count()} cpus, flags {flags}"


def host_defines(vendor: str | None = None, flags: str | None = None) -> tuple[str, ...]:
    """The defines of this CPU's own build beyond what -march=native decides: where the best setting was measured
    to depend on the vendor, not the instruction set (docs/kernels.md). On Intel CPUs with AVX-512 the next panel is
    prefetched from one batch row, and panels are taken 64 k rows at a time, a batch of 4 to 8 rows as two blocks.
    `vendor` and `flags` are /proc/cpuinfo's lines (read here when None)."""
    vendor = _cpuinfo("vendor_id") if vendor is None else vendor
    flags = _cpu_id() if flags is None else flags
    if "GenuineIntel" in vendor and "avx512f" in flags.split():
        return ("SLED_PREFETCH_MIN_ROWS=1", "SLED_KC=64", "SLED_KC_SPLIT_FROM=4")
    return ()


def cache_dir() -> Path:
    base = os.environ.get("SLED_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sled")
    return Path(base)


def load_library(defines: tuple[str, ...] = (), flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Build kernels/cpu_step.c for this CPU if no cached build matches, then load it. `defines` ("NAME=VALUE"),
    for tests and sweeps: a vector width or register blocking other than this CPU's default (SLED_VBYTES, NV, MR);
    none gives this CPU's own build (with `host_defines()`). `flags`, compiler flags after the usual ones (a test
    builds for AVX2 alone on an AVX-512 host with -mno-avx512f)."""
    if not defines and not flags:
        return _load(_own_defines(), ())
    return _load(tuple(defines), tuple(flags))


@functools.cache  # read /proc/cpuinfo once: load_library() is called on every step
def _own_defines() -> tuple[str, ...]:
    return host_defines()


@functools.cache  # one build and one load per process (per set of defines and flags)
def _load(defines: tuple[str, ...], flags: tuple[str, ...]) -> ctypes.CDLL:
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise CpuStepUnavailable(f"no C compiler ({compiler!r} not found)")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise CpuStepUnavailable(f"C compiler {compiler!r} does not run: {err}") from err
    flags = FLAGS + [f"-D{d}" for d in defines] + list(flags)
    key = hashlib.sha256("\0".join([SOURCE.read_text(), compiler, version, " ".join(flags), platform.machine(),
                                    _cpu_id()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"cpu_step-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        log.info("building the fused CPU step (%s) into %s", compiler, target)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            try:
                done = subprocess.run([compiler, *flags, str(SOURCE), "-o", str(out), "-lm"],
                                      capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.SubprocessError) as err:
                raise CpuStepUnavailable(f"building {SOURCE.name} failed: {err}") from err
            if done.returncode != 0:
                raise CpuStepUnavailable(f"building {SOURCE.name} failed:\n{done.stderr.strip()[-2000:]}")
            os.replace(out, target)  # atomic: a concurrent build leaves one complete file
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as err:
        raise CpuStepUnavailable(f"loading {target} failed: {err}") from err
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.sled_forward.argtypes = [p, i64, p, p, p, i64, i64, i64, p, p, p, ctypes.c_int]
    lib.sled_forward.restype = ctypes.c_int
    lib.sled_panel_width.argtypes = []
    lib.sled_panel_width.restype = i64
    lib.sled_row_argmax.argtypes = [p, i64, i64, p, ctypes.c_int]
    lib.sled_row_argmax.restype = None
    return lib


def row_argmax(x: torch.Tensor) -> torch.Tensor | None:
    """Per row of a [rows, n] float32 CPU tensor, the index of its largest value (the first of equal ones, as
    torch.argmax), or -1 where the row holds a NaN or an infinity; in one C pass (sled_row_argmax). None where
    that cannot run here (another device or dtype, or no C library): the caller takes PyTorch's way."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2:
        return None
    try:
        lib = load_library()
    except CpuStepUnavailable:
        return None
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.sled_row_argmax(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


def pack_panels(w: torch.Tensor, width: int) -> torch.Tensor:
    """A row-major [N, K] weight as the C side reads it: panels of `width` output rows, each stored k-major
    (panel p, k, j) = w[p width + j, k], the last panel padded with zero rows. Returns [panels, K, width]."""
    n, k = w.shape
    panels = -(-n // width)
    if panels * width != n:
        w = torch.cat([w, w.new_zeros(panels * width - n, k)])
    return w.reshape(panels, width, k).transpose(1, 2).contiguous()


class _Layer(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_void_p) for name in
                 ("ln1", "ln2", "wqkv", "bqkv", "wo", "bo", "wgu", "bgu", "wd", "bd", "k_cache", "v_cache", "qn",
                  "kn", "pn1", "pn2", "cos", "sin_signed")]
                + [("window", ctypes.c_int64)])


class _Model(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_int64) for name in
                 ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "inter", "vocab", "max_seq",
                  "block_size", "head_stride", "gelu")]
                + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]
                + [(name, ctypes.c_void_p) for name in ("norm", "lm_head", "lm_bias")]
                + [("layers", ctypes.POINTER(_Layer))])


@dataclass(frozen=True)
class StepModel:
    """What the fused step reads of a model: per layer its norms, projections and biases (ln1, ln2, q, k, v, o,
    gate, up, down; bq, bk, bv, bo, bgate, bup, bdown; qn and kn, the q and k heads' norms; pn1 and pn2, the norms
    of the attention's and the MLP's outputs (Gemma's); None where absent), its RoPE tables (cos, sin_signed: their
    rows bound positions) and sliding window (window, None: global); the final norm and logits projection, the KV pool
    ([layers, kv_heads, pool_rows, head_dim], blocks of block_size rows), the attention's shape and the MLP's
    activation (silu, or gelu_tanh)."""

    layers: Sequence[dict[str, torch.Tensor | None]]
    norm: torch.Tensor
    lm_head: torch.Tensor
    lm_bias: torch.Tensor | None
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float
    block_size: int
    activation: str = "silu"


class CpuStep:
    """A target's forward in one call per batch of tokens, over the runner's weights and KV pool: Llama's block, with
    Qwen3's q and k norms, Gemma 3's norms around attention and the MLP and its tanh GELU, sliding windows (Mistral,
    Gemma 3) and a RoPE table a layer where the model has several.

    Holds its own copies of the projection matrices (q/k/v and gate/up stacked, one matrix each; o, down and
    the logits projection), packed in the panels the C side's matrix products read; the norms, the cache and
    the RoPE tables are read in place. Float32 on CPU only."""

    def __init__(self, m: StepModel):
        layers, norm, lm_head, lm_bias, k_cache, v_cache = m.layers, m.norm, m.lm_head, m.lm_bias, m.k_cache, m.v_cache
        eps, scale = m.eps, m.scale
        num_heads, num_kv_heads, head_dim = m.num_heads, m.num_kv_heads, m.head_dim
        tensors = [norm, lm_head, k_cache, v_cache, *(lw[t] for lw in layers for t in ("cos", "sin_signed"))]
        if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
            raise CpuStepUnavailable("the fused CPU step runs float32 models on CPU only")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise CpuStepUnavailable("the KV pool must be contiguous")
        if num_heads % num_kv_heads or head_dim % 2:
            raise CpuStepUnavailable("heads must group evenly over KV heads and head_dim must be even")
        if m.activation not in ("silu", "gelu_tanh"):
            raise CpuStepUnavailable(f"the fused CPU step computes SiLU and GELU (tanh) MLPs, not {m.activation}")
        self.lib = load_library()
        self.build = Path(self.lib._name).stem  # the build's name: its source, compiler, flags and CPU, hashed
        num_layers, _, pool_rows, _ = k_cache.shape
        max_seq = layers[0]["cos"].shape[0]
        if pool_rows % m.block_size:
            raise CpuStepUnavailable("the KV pool's rows must be whole blocks")
        hidden = norm.shape[0]
        self.keep: list[torch.Tensor] = []  # everything the C side points into
        width = int(self.lib.sled_panel_width())

        def own(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            t = t.detach().contiguous()
            if t.dtype != torch.float32 or t.device.type != "cpu":
                raise CpuStepUnavailable("the fused CPU step runs float32 models on CPU only")
            self.keep.append(t)
            return t.data_ptr()

        def packed(w: torch.Tensor) -> int:  # own() checks the copy, which keeps w's dtype and device
            return own(pack_panels(w.detach(), width))

        def stack(ws: Sequence[torch.Tensor], bs: Sequence[torch.Tensor | None]) -> tuple[int, int | None]:
            w = torch.cat([x.detach() for x in ws]) if len(ws) > 1 else ws[0]
            b = None
            if any(x is not None for x in bs):
                b = torch.cat([x.detach() if x is not None else y.new_zeros(y.shape[0]) for x, y in zip(bs, ws)])
            return packed(w), own(b)

        inter = layers[0]["gate"].shape[0]
        self.layers = (_Layer * num_layers)()
        for i, lw in enumerate(layers):
            wqkv, bqkv = stack([lw["q"], lw["k"], lw["v"]], [lw["bq"], lw["bk"], lw["bv"]])
            wgu, bgu = stack([lw["gate"], lw["up"]], [lw["bgate"], lw["bup"]])
            if lw["cos"].shape[0] != max_seq:
                raise CpuStepUnavailable("every layer's RoPE tables must cover the same positions")
            self.layers[i] = _Layer(own(lw["ln1"]), own(lw["ln2"]), wqkv, bqkv, packed(lw["o"]), own(lw["bo"]),
                                    wgu, bgu, packed(lw["down"]), own(lw["bdown"]),
                                    k_cache[i].data_ptr(), v_cache[i].data_ptr(), own(lw.get("qn")), own(lw.get("kn")),
                                    own(lw.get("pn1")), own(lw.get("pn2")), own(lw["cos"]), own(lw["sin_signed"]),
                                    lw.get("window") or 0)
        self.k_cache, self.v_cache = k_cache, v_cache
        self.model = _Model(num_layers, hidden, num_heads, num_kv_heads, head_dim, inter, lm_head.shape[0], max_seq,
                            m.block_size, pool_rows * head_dim, int(m.activation == "gelu_tanh"), eps, scale,
                            own(norm), packed(lm_head), own(lm_bias), self.layers)
        self.num_blocks = pool_rows // m.block_size
        self.vocab = lm_head.shape[0]
        self.hidden, self.inter, self.max_seq = hidden, inter, max_seq
        self.qkv_width = (num_heads + 2 * num_kv_heads) * head_dim
        self.q_width = num_heads * head_dim
        self._scratch = torch.empty(0)

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
                 logit_rows: torch.Tensor) -> torch.Tensor:
        """h [num_tokens, hidden] (the embedded tokens, overwritten), positions [num_tokens] int64, tables
        [num_tokens, width] int64 (each token's session's block table, padded), logit_rows [num_logit_rows] int64
        -> logits [num_logit_rows, vocab] float32."""
        if h.dtype != torch.float32 or not h.is_contiguous() or h.shape[-1] != self.hidden:
            raise ValueError("h must be a contiguous float32 [num_tokens, hidden] tensor")
        m = h.shape[0]
        positions = positions.to(torch.int64).contiguous()
        tables = tables.to(torch.int64).contiguous()
        logit_rows = logit_rows.to(torch.int64).contiguous()
        if positions.shape != (m,) or tables.dim() != 2 or tables.shape[0] != m:
            raise ValueError("positions and block tables must have one entry per token")
        threads = torch.get_num_threads()
        need = m * (max(self.hidden, self.inter) + self.qkv_width + self.q_width + 2 * self.inter + self.hidden) \
            + threads * self.max_seq
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32)
        logits = torch.empty(logit_rows.shape[0], self.vocab, dtype=torch.float32)
        rc = self.lib.sled_forward(ctypes.byref(self.model), m, h.data_ptr(), positions.data_ptr(), tables.data_ptr(),
                                   tables.shape[1], self.num_blocks, logit_rows.shape[0], logit_rows.data_ptr(),
                                   logits.data_ptr(),
                                   self._scratch.data_ptr(), threads)
        if rc != 0:
            raise ValueError("a position, block or logit row is out of range")
        return logits
