"""The fused CPU step (kernels/cpu_step.c) against PyTorch's reference path of the same runner, on small random
models whose shapes reach every branch: head sizes with and without a specialized loop, widths that leave tails in
the matrix products, biases (Qwen2), q and k norms (Qwen3), Gemma 3's block, sliding windows, grouped heads, ragged
batches over several slots, and a poisoned cache."""

import ctypes
import dataclasses
import platform

import pytest
import torch

from kernels.attention import Segment
from kernels.cpu_step import load_library
from verify_server.kv_cache import KVCache, KVLayout
from verify_server.model_runner import CalibrationPlan, FusedCalibration, ModelInput, ModelRunner

# No skip when the library cannot be built: `make test` needs a C compiler anyway (llama-cpp-python builds from
# source), so a failed build here is a defect to see, and these tests fail with the compiler's message.

POISON = 1e4  # what fills every cache position no token has written: reading one shows in the logits


def _model(kind: str, hidden: int, heads: int, kv_heads: int, inter: int, vocab: int, layers: int = 2):
    import transformers

    cfg_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                          "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                          "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
                          "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
                          "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[kind]
    cfg = cfg_cls(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  intermediate_size=inter, vocab_size=vocab, num_hidden_layers=layers, max_position_embeddings=64,
                  tie_word_embeddings=False, head_dim=hidden // heads, **EXTRA.get(kind, {}))
    torch.manual_seed(0)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # larger than the init's 0.02 so that every term moves the logits
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


# Windows shorter than the longest sessions below (36 positions), starting inside a block of 4 and at its first row.
EXTRA = {
    # a sliding layer and a global one, each with its RoPE table; attention scaled by its own scalar
    "gemma3_text": dict(query_pre_attn_scalar=24, sliding_window=5, layer_types=["sliding_attention", "full_attention"],
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}}),
    "mistral": dict(sliding_window=8),
}

BLOCK = 4  # tokens a block of the test pools


def _tables(sessions: int, max_seq: int) -> list[tuple[int, ...]]:
    """Each session's block table: the pool's blocks dealt out shuffled, so that no session's blocks are
    consecutive and every read crosses blocks."""
    per = max_seq // BLOCK
    order = torch.randperm(sessions * per, generator=torch.Generator().manual_seed(7)).tolist()
    return [tuple(order[i * per:(i + 1) * per]) for i in range(sessions)]


def _runners(model, slots=3, max_seq=48):
    """Two runners over pools of `slots` sessions of max_seq positions (kv.tables: their block tables)."""
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    caches = []
    for _ in range(2):
        kv = KVCache(KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim), slots * max_seq // BLOCK,
                     BLOCK, max_seq)
        kv.tables = _tables(slots, max_seq)
        kv.k.fill_(POISON)
        kv.v.fill_(POISON)
        caches.append(kv)
    fused = ModelRunner(model, caches[0], "sdpa", "reference", fused="on", fused_max_tokens=64)
    reference = ModelRunner(model, caches[1], "reference", "reference", fused="off")
    assert fused.fused is not None and reference.fused is None
    return fused, reference


def _batch(parts, vocab, gen, tables=None):
    """parts: (session, start position, length); every token's logits."""
    tables = tables or _tables(3, 48)
    tokens, segments = [], []
    for slot, start, length in parts:
        segments.append(Segment(tables[slot], len(tokens), length, start + length, BLOCK))
        tokens += torch.randint(0, vocab, (length,), generator=gen).tolist()
    return ModelInput.build(tokens, segments, list(range(len(tokens))))


SHAPES = {
    # kind, hidden, heads, kv heads, intermediate, vocab
    "head64-gqa": ("llama", 128, 2, 1, 96, 203),       # head_dim 64: the specialized attention loop
    "head10-tails": ("llama", 40, 4, 2, 72, 101),      # head_dim 10: generic loops; no width a multiple of 16
    "qwen2-bias-head16": ("qwen2", 64, 4, 2, 80, 130),  # q/k/v biases
    "qwen3-qk-norm-head16": ("qwen3", 64, 4, 2, 80, 130),  # an RMSNorm over each q and k head before RoPE
    "gemma3-head16": ("gemma3_text", 64, 4, 2, 80, 130),  # Gemma's norms, tanh GELU, two RoPEs, a sliding layer
    "mistral-window-head16": ("mistral", 64, 4, 2, 80, 130),  # every layer sliding
    "head128": ("llama", 256, 2, 2, 64, 97),
}


# The kernel's vector width and register blocking depend on the CPU it is built for (AVX-512 or not); every
# layout is built here with -D, so each is checked on any host that can run it. Named vector floats x vectors
# per panel x batch rows per block; every shape below has a projection whose width is not a multiple of the
# panel (a padded last panel), and the steps have row counts that split into blocks of every height from 1 to
# the layout's MR (each height is its own function in the kernel), balanced or MR rows a block first.
LAYOUTS = {
    "native": (),
    "avx2-8x2x6": ("SLED_VBYTES=32", "NV=2", "MR=6"),
    # AVX-512's blocking (up to 8 rows a block where two blocks take the batch, 6 where more are needed), for hosts
    # without it; and the 6-row blocks it had before, kept buildable for comparisons
    "avx512-16x2x8": ("SLED_VBYTES=64", "NV=2", "MR=8"),
    "avx512-16x2x6": ("SLED_VBYTES=64", "NV=2", "MR=6"),
    # 24-wide panels, 7-row blocks; the attention's lane shuffles as older GCCs (11) build them
    "odd-8x3x7": ("SLED_VBYTES=32", "NV=3", "MR=7", "SLED_GCC_SHUFFLE=1"),
    # the earlier prefetch (the first block of a panel asks for all of the next), kept buildable for comparisons
    "avx2-8x2x6-first-block-prefetch": ("SLED_VBYTES=32", "NV=2", "MR=6", "SLED_PREFETCH_SPREAD=0"),
    # the earlier row blocks (MR rows each, the rest in the last), kept buildable for comparisons
    "avx2-8x2x6-full-blocks-first": ("SLED_VBYTES=32", "NV=2", "MR=6", "SLED_BALANCED_BLOCKS=0"),
    # 32-float panels prefetch from 8 rows; the earlier threshold (3), kept buildable for comparisons
    "avx512-16x2x6-prefetch-from-3": ("SLED_VBYTES=64", "NV=2", "MR=6", "SLED_PREFETCH_MIN_ROWS=3"),
    # what Intel AVX-512 CPUs build (host_defines): the next panel prefetched from one row, every block size
    "avx512-16x2x8-prefetch-from-1": ("SLED_VBYTES=64", "NV=2", "MR=8", "SLED_PREFETCH_MIN_ROWS=1"),
    # panels taken a chunk of k rows at a time by all their row blocks, and one block's rows taken as two from
    # SLED_KC_SPLIT_FROM (Intel AVX-512 CPUs build 64 and 4, host_defines): chunks of 16 here, so every shape's
    # widths (40 to 256) take several, most with a shorter last one; split from 2 rows (1 + 1)
    "avx512-16x2x8-k-chunks": ("SLED_VBYTES=64", "NV=2", "MR=8", "SLED_PREFETCH_MIN_ROWS=1", "SLED_KC=16",
                               "SLED_KC_SPLIT_FROM=4"),
    "avx2-8x2x6-k-chunks": ("SLED_VBYTES=32", "NV=2", "MR=6", "SLED_KC=16", "SLED_KC_SPLIT_FROM=2"),
    # chunks without the spread prefetch, and for two blocks at most (three fall back to whole panels)
    "avx2-8x2x6-k-chunks-first-block-prefetch": ("SLED_VBYTES=32", "NV=2", "MR=6", "SLED_KC=24",
                                                 "SLED_PREFETCH_SPREAD=0", "SLED_KC_BLOCKS=2"),
}
# The 8-float layouts are built without AVX-512 on x86, so an AVX-512 host builds what an AVX2-only CPU builds
# (an intrinsic whose header was included for AVX-512 alone once broke the build on AVX2 CPUs only).
AVX2_ONLY = ("-mno-avx512f",) if platform.machine() in ("x86_64", "AMD64") else ()


def layout_library(layout: str):
    defines = LAYOUTS[layout]
    return load_library(defines, AVX2_ONLY if "SLED_VBYTES=32" in defines else ())


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fused_step_matches_reference_over_ragged_batches(shape, layout, monkeypatch):
    import kernels.cpu_step as cpu_step

    monkeypatch.setattr(cpu_step, "load_library", lambda: layout_library(layout))
    kind, *dims = SHAPES[shape]
    model = _model(kind, *dims)
    fused, reference = _runners(model)
    vocab = dims[-1]
    gen = torch.Generator().manual_seed(1)
    # Prefills of two slots in one batch, then decode tokens and drafts of several slots together, out of order.
    # Rows per step: 10, 1, 8, 9, 6, 11, 5, 2, 3, 7, 13 and 18. Balanced blocks, at most 6 rows: 5+5, 1, 4+4,
    # 5+4, 6, 6+5, 5, 2, 3, 4+3, 5+4+4, 6+6+6; at most 7 (6 past two blocks): 5+5, 1, 4+4, 5+4, 6, 6+5, 5, 2, 3,
    # 7, 7+6, 6+6+6; at most 8 (6 past two blocks): 5+5, 1, 8, 5+4, 6, 6+5, 5, 2, 3, 7, 7+6, 6+6+6; 6 rows a
    # block first: 6+4, 1, 6+2, 6+3, 6, 6+5, 5, 2, 3, 6+1, 6+6+1, 6+6+6.
    steps = [[(0, 0, 7), (2, 0, 3)], [(2, 3, 1)], [(0, 7, 5), (2, 4, 1), (1, 0, 2)], [(1, 2, 9)],
             [(2, 5, 4), (0, 12, 1), (1, 11, 1)], [(0, 13, 6), (2, 9, 5)], [(1, 12, 5)], [(0, 19, 2)],
             [(1, 17, 3)], [(2, 14, 7)], [(0, 21, 6), (1, 20, 7)], [(0, 27, 9), (1, 27, 9)]]
    for parts in steps:
        inp = _batch(parts, vocab, gen)
        got, want = fused.forward(inp), reference.forward(inp)
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (parts, (got - want).abs().max().item())
    # The caches agree where tokens were written, and nothing else was touched.
    assert torch.allclose(fused.kv.k, reference.kv.k, atol=1e-4, rtol=1e-4)
    assert torch.allclose(fused.kv.v, reference.kv.v, atol=1e-4, rtol=1e-4)
    written = {slot: max(start + length for parts in steps for s, start, length in parts if s == slot)
               for slot in range(3)}
    for slot, end in written.items():
        rows = fused.kv.rows(list(fused.kv.tables[slot]), 0, 48)
        assert (fused.kv.k[:, :, rows[end:]] == POISON).all()
        assert (fused.kv.k[:, :, rows[:end]] != POISON).all()


def test_rollback_then_rewrite_reads_only_what_the_row_may_see():
    """A rejected draft leaves its keys in the cache past the session's length; the next pass writes over the
    first of them and must not attend to the rest (positions after the row's own)."""
    model = _model(*SHAPES["head64-gqa"])
    fused, reference = _runners(model)
    gen = torch.Generator().manual_seed(2)
    for parts in ([(0, 0, 6)], [(0, 6, 8)], [(0, 7, 1)], [(0, 8, 3)]):  # 8 drafted, 1 kept, then on from there
        inp = _batch(parts, 203, gen)
        got, want = fused.forward(inp), reference.forward(inp)
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), parts


def test_out_of_range_rows_are_refused_before_anything_is_written():
    model = _model(*SHAPES["head10-tails"])
    fused, _ = _runners(model, slots=2, max_seq=16)  # 8 blocks of 4
    before = fused.kv.k.clone()
    table = torch.tensor([fused.kv.tables[0]])
    with pytest.raises(ValueError, match="out of range"):  # position 16 of 16
        fused.fused(torch.zeros(2, 40), torch.tensor([15, 16]), table.repeat(2, 1), torch.arange(2))
    with pytest.raises(ValueError, match="out of range"):  # block 9: past the 8 and the scratch block
        fused.fused(torch.zeros(1, 40), torch.tensor([5]), torch.tensor([[0, 9, 1, 2]]), torch.arange(1))
    with pytest.raises(ValueError, match="out of range"):  # position 5 past a table of one block
        fused.fused(torch.zeros(1, 40), torch.tensor([5]), torch.tensor([[0]]), torch.arange(1))
    with pytest.raises(ValueError, match="out of range"):
        fused.fused(torch.zeros(1, 40), torch.tensor([0]), table, torch.tensor([1]))  # logit row 1 of 1
    assert torch.equal(fused.kv.k, before)


def test_segments_that_disagree_with_positions_are_refused():
    """The fused step attends by position; a segment saying otherwise would be attended differently by the two
    paths, so it is an error, with the cache untouched."""
    model = _model(*SHAPES["head10-tails"])
    fused, _ = _runners(model)
    before = fused.kv.k.clone()
    a, b = fused.kv.tables[0], fused.kv.tables[1]
    good = ModelInput.build([5, 6], [Segment(a, 0, 2, 2, BLOCK)], [0, 1])
    bad = [dataclasses.replace(good, positions=torch.tensor([3, 4]),
                               segments=[Segment(a, 0, 2, 6, BLOCK)]),  # context 6, but the tokens sit at 3 and 4
           dataclasses.replace(good, tables=torch.tensor([a, b])),  # the second token has another session's table
           dataclasses.replace(good, segments=[Segment(a, 0, 1, 1, BLOCK)])]  # a token in no segment
    for inp in bad:
        with pytest.raises(ValueError, match="segment"):
            fused.forward(inp)
    assert torch.equal(fused.kv.k, before)


def test_batches_past_the_threshold_take_pytorch(monkeypatch):
    model = _model(*SHAPES["head10-tails"])
    fused, reference = _runners(model)
    fused.fused_max_tokens = 4
    calls = []
    step = fused.fused
    monkeypatch.setattr(fused, "fused", lambda *a: calls.append(a[0].shape[0]) or step(*a))
    gen = torch.Generator().manual_seed(3)
    for parts in ([(0, 0, 5)], [(0, 5, 4)], [(0, 9, 1), (1, 0, 4)]):
        inp = _batch(parts, 101, gen)
        assert torch.allclose(fused.forward(inp), reference.forward(inp), atol=1e-4, rtol=1e-4)
    assert calls == [4]


def test_calibration_sets_the_threshold_where_the_fused_step_stops_winning():
    """fused_max_tokens unset: the warm-up bisects the sizes, timing both paths at each, and keeps the fused step
    up to the last size it wins; a win rules in the sizes below it, a loss those above."""
    model = _model(*SHAPES["head10-tails"])
    fused, _ = _runners(model)
    cost = {1: (1, 2), 2: (2, 3), 4: (3, 4), 8: (5, 5), 12: (7, 6), 16: (9, 8)}  # n: (fused, PyTorch)
    seen = []
    ratios = fused.calibrate_fused(list(fused.kv.tables[0]), plan=CalibrationPlan(tuple(cost)),
                                   timer=lambda n, f: seen.append((n, f)) or cost[n][not f]).ratios
    assert fused.fused_max_tokens == 8  # ties count as a win; 12 loses
    assert list(ratios) == [8, 12, 16] and ratios[12] == pytest.approx(7 / 6)
    assert [n for n, f in seen if f] == [8] * 3 + [16] * 9 + [12] * 9  # 1, 2 and 4 are never timed
    assert seen[:6] == [(8, True), (8, False)] * 3  # alternated, three times each
    # Every size wins, or every size loses: the search ends at the largest, or the smallest.
    assert fused.calibrate_fused(list(fused.kv.tables[0]), plan=CalibrationPlan(tuple(cost)),
                                 timer=lambda n, f: 1.0 if f else 2.0).max_tokens == 16
    assert fused.calibrate_fused(list(fused.kv.tables[0]), plan=CalibrationPlan(tuple(cost)),
                                 timer=lambda n, f: 2.0 if f else 1.0).max_tokens == 0
    # Measured for real (threshold within the sizes tried), the forwards it ran leave the runner as it was.
    ratios = fused.calibrate_fused(list(fused.kv.tables[1]), plan=CalibrationPlan((1, 2, 4, 8), repeats=1)).ratios
    assert set(ratios) <= {1, 2, 4, 8} and fused.fused_max_tokens in (0, *ratios)


def test_a_size_pytorch_seems_to_win_is_timed_again_before_the_calibration_stops_there():
    """One disturbed stretch (a fresh or busy host) made the fused step look slower at a size where it wins,
    and the threshold stopped there, sending a loaded server's large steps through PyTorch. A loss is
    timed again; a real one still bounds the threshold, after the re-timing."""
    model = _model(*SHAPES["head10-tails"])
    fused, _ = _runners(model)
    seen = []

    def blip(n, f):  # at 8 tokens the first three pairs find the fused step disturbed; it wins everywhere else
        seen.append((n, f))
        if n == 8 and f and seen.count((8, True)) <= 3:
            return 20.0
        return 4.0 if f else 5.0

    ratios = fused.calibrate_fused(list(fused.kv.tables[0]), plan=CalibrationPlan((1, 2, 4, 8, 12, 16)), timer=blip).ratios
    assert fused.fused_max_tokens == 16 and ratios[8] == pytest.approx(0.8)
    assert seen.count((8, True)) == seen.count((8, False)) == 6  # one more round of three pairs at 8
    assert seen.count((16, True)) == 3

    seen.clear()
    real_loss = {1: (1, 2), 2: (2, 3), 4: (5, 4), 8: (1, 9)}  # PyTorch wins at 4 every time; 8 is never tried
    ratios = fused.calibrate_fused(list(fused.kv.tables[0]), plan=CalibrationPlan(tuple(real_loss)),
                                   timer=lambda n, f: seen.append((n, f)) or real_loss[n][not f]).ratios
    assert fused.fused_max_tokens == 2 and list(ratios) == [2, 4]
    assert seen.count((4, True)) == seen.count((4, False)) == 9  # three rounds of three pairs
    seen.clear()
    fused.calibrate_fused(list(fused.kv.tables[0]), plan=CalibrationPlan(tuple(real_loss), confirm=0),
                          timer=lambda n, f: seen.append((n, f)) or real_loss[n][not f])
    assert fused.fused_max_tokens == 2
    assert seen.count((4, True)) == 3  # confirm=0: no re-timing


def test_a_calibration_past_its_time_bound_stops_keeps_a_safe_threshold_and_goes_on_later():
    """A loaded host times every size slowly: no pair is begun that would end past budget_s (as long as the size's
    last pair took), the threshold is the largest win so far, at least the uncalibrated default below any loss,
    and the outcome says it was cut. A later calibration given those ratios times only the sizes still open."""
    from verify_server.model_runner import UNCALIBRATED_FUSED_MAX_TOKENS

    model = _model(*SHAPES["head10-tails"])
    fused, _ = _runners(model)
    now, seen = [0.0], []
    sizes = (1, 2, 4, 8, 12, 16, 24, 32)

    def slow(n, f):  # every timing moves the clock by a second (a pair, two); the fused step wins up to 12 tokens
        now[0] += 1.0
        seen.append(n)
        return (4.0 if f else 5.0) if n <= 12 else (5.0 if f else 4.0)

    def calibrate(budget_s, **kw):
        now[0] = 0.0
        seen.clear()
        return fused.calibrate_fused(list(fused.kv.tables[0]), plan=CalibrationPlan(sizes), timer=slow, budget_s=budget_s,
                                     clock=lambda: now[0], **kw)

    done = calibrate(3.0)  # 6 s a size: cut inside the first, which does not count; no pair begun to end late
    assert done.cut and done.ratios == {} and now[0] == 2.0
    assert done.max_tokens == fused.fused_max_tokens == UNCALIBRATED_FUSED_MAX_TOKENS
    done = calibrate(10.0)  # 12 wins; 24, which loses, is cut inside its re-timing
    assert done.cut and list(done.ratios) == [12] and done.max_tokens == 12
    done = calibrate(20.0, known={12: 0.8, 24: 1.25})  # an earlier start found 12 to win, 24 to lose
    assert not done.cut and seen == [16] * 18 and done.max_tokens == 12 and list(done.ratios) == [12, 16, 24]
    done = calibrate(3.0, known={4: 1.25})  # a known loss at 4 keeps a cut threshold below it
    assert done.cut and done.max_tokens == 0
    done = calibrate(100.0)
    assert not done.cut and done.max_tokens == 12 and seen == [12] * 6 + [24] * 18 + [16] * 18


@pytest.mark.model
def test_the_engine_measures_the_threshold_only_when_it_is_unset(target, tmp_path):
    from verify_server.config import ServerConfig
    from verify_server.engine import Engine

    set_ = Engine(ServerConfig(max_sessions=2, max_seq_len=128, fused_max_tokens=5, start_cache_dir=str(tmp_path)),
                  target)
    set_.warmup()
    assert set_.runner.fused_max_tokens == 5
    assert not list(tmp_path.iterdir())  # nothing measured, nothing kept
    measured = Engine(ServerConfig(max_sessions=2, max_seq_len=128, start_cache=False), target)
    calls = []
    real = measured.runner.calibrate_fused
    measured.runner.calibrate_fused = lambda blocks, **kw: calls.append(blocks) or real(
        blocks, plan=CalibrationPlan((1, 2), repeats=1), **kw)
    measured.warmup()
    assert len(calls) == 1 and measured.runner.fused_max_tokens in (0, 1, 2)
    assert measured.kv.blocks.num_free == measured.kv.num_blocks  # the warm-up's blocks are back


@pytest.mark.model
def test_a_restart_keeps_the_measured_threshold_and_measures_again_past_a_corrupt_or_stale_entry(target, tmp_path):
    """The first start measures and keeps the threshold; a restart with the same key reads it without measuring; a
    corrupt entry, or another key (threads here), is measured again and rewritten."""
    from verify_server.config import ServerConfig
    from verify_server.engine import Engine

    calls = []

    def start():
        engine = Engine(ServerConfig(max_sessions=2, max_seq_len=128, start_cache_dir=str(tmp_path)), target)
        engine.runner.calibrate_fused = lambda blocks, **kw: calls.append(kw) or engine.runner.set_fused_max_tokens(
            len(calls) + 2) or FusedCalibration(len(calls) + 2, {1: 0.5}, False)
        engine.warmup()
        return engine

    first = start()
    assert len(calls) == 1 and calls[0]["budget_s"] == 15.0 and first.runner.fused_max_tokens == 3
    (entry,) = tmp_path.iterdir()
    assert start().runner.fused_max_tokens == 3 and len(calls) == 1  # kept: not measured again
    entry.write_text(entry.read_text().replace('"fused_max_tokens": 3', '"fused_max_tokens": 300'))
    assert start().runner.fused_max_tokens == 4 and len(calls) == 2  # its checksum fails: measured, rewritten
    assert start().runner.fused_max_tokens == 4 and len(calls) == 2
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert start().runner.fused_max_tokens == 5 and len(calls) == 3  # another key: measured, kept beside
    finally:
        torch.set_num_threads(threads)
    assert len(list(tmp_path.iterdir())) == 2
    assert start().runner.fused_max_tokens == 4 and len(calls) == 3


def test_fused_modes():
    model = _model(*SHAPES["head10-tails"])
    kv = KVCache(KVLayout(2, 2, 10), 2, 4, 8)
    assert ModelRunner(model, kv, fused="auto").fused is not None
    assert ModelRunner(model, kv, fused="off").fused is None
    with pytest.raises(ValueError, match="fused must be"):
        ModelRunner(model, kv, fused="fast")
    half = KVCache(KVLayout(2, 2, 10, torch.bfloat16), 2, 4, 8)
    assert ModelRunner(model.to(torch.bfloat16), half, fused="auto").fused is None  # float32 only: PyTorch
    with pytest.raises(ValueError, match="fused: on, but"):
        ModelRunner(model, half, fused="on")


def test_intel_avx512_cpus_build_with_the_next_panel_prefetched_from_one_row():
    from kernels import cpu_step

    intel, amd = "vendor_id\t: GenuineIntel", "vendor_id\t: AuthenticAMD"
    avx512, avx2 = "flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512vl", "flags\t\t: fpu sse2 avx avx2 fma"
    assert cpu_step.host_defines(intel, avx512) == ("SLED_PREFETCH_MIN_ROWS=1", "SLED_KC=64", "SLED_KC_SPLIT_FROM=4")
    assert cpu_step.host_defines(amd, avx512) == ()  # measured better from 8 rows (cpu_step.c)
    assert cpu_step.host_defines(intel, avx2) == ()  # not measured: the AVX2 default (3 rows) stays
    assert cpu_step.host_defines("", "Features\t: fp asimd") == ()  # an ARM CPU
    assert cpu_step.host_defines(intel, "flags\t\t: avx512fx") == ()  # a whole flag, not a prefix
    # this CPU's own build is the one with its host defines, loaded once
    assert load_library() is cpu_step._load(cpu_step.host_defines(), ())
    assert load_library() is load_library()


def test_vector_exp_is_within_a_few_ulp():
    lib = load_library()
    lib.sled_exp.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    x = torch.linspace(-87.0, 88.0, 200_003, dtype=torch.float32)  # not a multiple of 16: the tail too
    got = x.clone()
    lib.sled_exp(got.data_ptr(), got.numel())
    want = x.double().exp()
    assert ((got.double() - want).abs() / want).max().item() < 2e-7
    low = torch.tensor([-1e4, -100.0, float("-inf")])  # clamped: as small as e^-87, never NaN
    lib.sled_exp(low.data_ptr(), 3)
    assert torch.all(low >= 0) and torch.all(low < 2e-38)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_row_argmax_matches_torch_and_flags_every_non_finite_row(layout, monkeypatch):
    from kernels import cpu_step

    monkeypatch.setattr(cpu_step, "load_library", lambda: layout_library(layout))
    torch.manual_seed(1)
    for rows, n in ((1, 1), (3, 7), (5, 16), (9, 49_152 + 5), (40, 2_000)):  # tails; the last two are threaded
        x = torch.randn(rows, n)
        x[0, -1] = 50.0  # the largest in the tail
        if n > 1:
            x[-1, :] = -3.0  # all equal: the first wins
            x[rows // 2, n // 2] = x[rows // 2, n - 1] = 60.0  # a tie across the vector part and the tail
        assert torch.equal(cpu_step.row_argmax(x), x.argmax(dim=-1)), (rows, n)
    x = torch.randn(6, 100)
    x[1, 99], x[2, 0], x[3, 50], x[4, 98] = float("nan"), float("inf"), float("-inf"), float("nan")
    x[4, 3] = 1e30  # larger than the rest, still finite: the NaN flags the row
    got = cpu_step.row_argmax(x)
    assert got[[1, 2, 3, 4]].tolist() == [-1, -1, -1, -1]
    assert torch.equal(got[[0, 5]], x[[0, 5]].argmax(dim=-1))
    assert cpu_step.row_argmax(x.double()) is None and cpu_step.row_argmax(x[0]) is None  # PyTorch's way then
    y = torch.randn(100, 6).t()  # not contiguous: copied first
    assert torch.equal(cpu_step.row_argmax(y), y.argmax(dim=-1))


def test_a_prefill_step_without_logit_rows_writes_the_cache_and_returns_no_logits():
    """A step of prompt prefill alone asks for no logits: the logits projection runs over zero rows (once a
    division by zero there killed the server with SIGFPE at its first prompt)."""
    model = _model(*SHAPES["head64-gqa"])
    fused, reference = _runners(model)
    gen = torch.Generator().manual_seed(3)
    for parts in ([(0, 0, 9), (1, 0, 4)], [(0, 9, 2)]):
        inp = _batch(parts, 203, gen)
        inp = dataclasses.replace(inp, logit_rows=torch.zeros(0, dtype=torch.long))
        got, want = fused.forward(inp), reference.forward(inp)
        assert got.shape == want.shape == (0, 203)
    rows = fused.kv.rows(list(fused.kv.tables[0]), 0, 11) + fused.kv.rows(list(fused.kv.tables[1]), 0, 4)
    assert torch.allclose(fused.kv.k[:, :, rows], reference.kv.k[:, :, rows], atol=1e-4, rtol=1e-4)
    assert torch.allclose(fused.kv.v[:, :, rows], reference.kv.v[:, :, rows], atol=1e-4, rtol=1e-4)


@pytest.mark.model
def test_a_cut_calibration_is_kept_and_the_next_start_goes_on_from_it(target, tmp_path):
    """A slow or loaded host's first start is cut by the bound: what it measured is kept, the next start times only
    what is left, and once complete a restart measures nothing."""
    from verify_server.config import ServerConfig
    from verify_server.engine import Engine

    calls, outcomes = [], [FusedCalibration(8, {32: 0.7}, True), FusedCalibration(64, {32: 0.7, 64: 0.9, 96: 1.1},
                                                                                    False)]

    def start():
        engine = Engine(ServerConfig(max_sessions=2, max_seq_len=128, start_cache_dir=str(tmp_path)), target)

        def calibrate(blocks, **kw):
            calls.append(kw["known"])
            done = outcomes[len(calls) - 1]
            engine.runner.set_fused_max_tokens(done.max_tokens)
            return done

        engine.runner.calibrate_fused = calibrate
        engine.warmup()
        return engine

    assert start().runner.fused_max_tokens == 8 and calls == [{}]
    assert start().runner.fused_max_tokens == 64 and calls == [{}, {32: 0.7}]  # went on from the first's ratios
    assert start().runner.fused_max_tokens == 64 and len(calls) == 2  # complete: kept, not measured again


@pytest.mark.model
def test_a_threshold_measured_against_eager_is_not_kept_for_a_compiled_step(target, tmp_path):
    """The fused step's crossover depends on what it is measured against: the start cache keys it by the compiled
    step too, so turning `compile` on measures it again."""
    import types

    from verify_server.config import ServerConfig
    from verify_server.engine import Engine

    engine = Engine(ServerConfig(max_sessions=2, max_seq_len=128, start_cache_dir=str(tmp_path)), target)
    eager = engine.start_key()
    engine.runner.compiled = types.SimpleNamespace(attention="segments")
    try:
        assert engine.start_key() != eager and engine.start_key()["compiled"] == "segments"
    finally:
        engine.runner.compiled = None
