"""The step compiled whole (verify_server/compiled.py), on the CPU: no graph break, no recompile after warm-up, and
greedy tokens equal to transformers' (so to the eager path's) for the five families, in every bucket, through
drafts rejected across a block boundary and accepted past it again; with FlexAttention in the graph (CUDA's
attention) for Llama too."""

import pytest
import torch

from tests.integration.test_families import FAMILIES, build_folder, reference
from tests.verify_server.test_paged_kv import Driver

pytestmark = pytest.mark.model

KINDS = ["llama", "qwen2"] + list(FAMILIES)


def tiny_target(kind: str, folder):
    """A tiny random target of the family, built in `folder` and loaded."""
    from verify_server.model_loader import load_target

    if kind in FAMILIES:
        build_folder(kind, folder)
    else:
        FAMILIES[kind] = dict(rope_theta=10000.0)  # Llama's block; Qwen2 adds q/k/v biases
        try:
            build_folder(kind, folder)
        finally:
            del FAMILIES[kind]
    return load_target(folder, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module", params=KINDS)
def family(request, tmp_path_factory):
    kind = request.param
    return kind, tiny_target(kind, tmp_path_factory.mktemp(kind))


@pytest.fixture(scope="module")
def engine(family):
    """An engine of the family's target with the compiled step, warmed up (every bucket compiled)."""
    return engine_of(family[1])


PROMPTS = [[1, 504, 3458, 314, 1345, 30, 1073, 2117, 7050, 28, 2683, 359, 253, 5356, 5646, 11, 288, 260, 1345, 314,
            4172, 30, 378], [1, 2683, 359, 253, 5356, 5646, 11, 288, 260]]


def engine_of(target, attention: str = "auto"):
    from verify_server.compiled import CompiledStep
    from verify_server.config import ServerConfig
    from verify_server.engine import Engine

    # blocks of 4 positions, steps of at most 16 tokens: the buckets are 8 and 16 (and 1, 2, 4 with segments)
    config = ServerConfig(max_sessions=4, max_seq_len=128, kv_block_size=4, max_batch_tokens=16, max_draft_tokens=7,
                          prefix_cache_tokens=0, fused="off", compile="on")
    engine = Engine(config, target)
    if attention != "auto":
        engine.runner.compiled = CompiledStep(engine.runner, config.max_batch_tokens, attention)
    engine.warmup()
    return engine


@pytest.fixture(scope="module")
def flex_engine(tmp_path_factory):
    """A Llama engine whose compiled step calls FlexAttention in its graph, as on CUDA (the CPU's auto calls the
    runner's per-segment attention)."""
    target = tiny_target("llama", tmp_path_factory.mktemp("llama-flex"))
    return target, engine_of(target, "flex")


def rounds_match(engine, want: list[list[int]], label: str) -> None:
    """Two sessions of PROMPTS, eight rounds under fail_on_recompile: a wrong draft of 7 (rejected across a block
    boundary), then the right 7, in turn; the second session sits out every third round, so steps of 8 tokens and
    of 16 both come. Every verdict's tokens must be `want`'s."""
    drive = Driver(engine)
    got: list[list[int]] = [[], []]
    sizes = []
    real = engine.runner.compiled.forward
    engine.runner.compiled.forward = lambda inp: sizes.append(inp.token_ids.shape[0]) or real(inp)
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            sessions = [drive.open(p) for p in PROMPTS]
            drive.prefill_all()  # 22 + 8 prompt tokens in steps of at most 16
            for i in range(8):
                answers = []
                for j, s in enumerate(sessions):
                    if i % 3 == 2 and j:
                        answers.append(None)
                        continue
                    draft = want[j][len(got[j]):len(got[j]) + 7] if i % 2 else [0] * 7
                    answers.append((draft, drive.verify(s, draft)))
                drive.run([a[1] for a in answers if a is not None])
                for j, a in enumerate(answers):
                    if a is None:
                        continue
                    draft, (verdict,) = a
                    got[j] += list(draft[:verdict.n_accepted]) + [verdict.next_token]
                    assert got[j] == want[j][:len(got[j])], (label, i, j)
                    assert len(sessions[j].blocks) == -(-sessions[j].kv_len // 4)
    finally:
        engine.runner.compiled.forward = real
    for s in sessions:
        engine._close(s.id)
    assert min(len(g) for g in got) >= 20
    assert {8, 16} <= {engine.runner.compiled.bucket(n) for n in sizes}  # every bucket served real steps


def test_compiled_greedy_tokens_are_transformers_in_every_bucket_without_a_recompile(family, engine):
    kind, target = family
    rounds_match(engine, [reference(target, p, 40) for p in PROMPTS], kind)


def test_compiled_greedy_tokens_of_the_smollm2_target_are_transformers(target, reference_greedy):
    want = [reference_greedy(tuple(p), 40) for p in PROMPTS]
    assert min(len(w) for w in want) == 40  # no EOS inside: every round has tokens to draft
    rounds_match(engine_of(target), want, "SmolLM2")


def test_compiled_flex_greedy_tokens_are_transformers_in_every_bucket_without_a_recompile(flex_engine):
    target, engine = flex_engine
    assert engine.runner.compiled.attention == "flex"
    rounds_match(engine, [reference(target, p, 40) for p in PROMPTS], "llama, flex")


def test_a_step_past_the_largest_bucket_runs_eager(engine):
    """A calibration's forward of more tokens than any bucket holds goes through the eager path, not a new
    compile (the scheduler itself never builds one)."""
    from kernels.attention import Segment
    from verify_server.model_runner import ModelInput

    blocks = engine.kv.blocks.allocate(6)
    inp = ModelInput.build(list(range(5, 25)), [Segment(tuple(blocks), 0, 20, 20, 4)], list(range(20)))
    calls = []
    step = engine.runner.compiled
    real = step.forward
    step.forward = lambda i: calls.append(i) or real(i)
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            got = engine.runner.forward(inp)
    finally:
        step.forward = real
    engine.runner.compiled = None
    try:
        want = engine.runner.forward(inp)
    finally:
        engine.runner.compiled = step
    engine.kv.blocks.free(blocks)
    assert not calls and torch.equal(got, want)


def traces_whole(engine) -> None:
    from kernels.attention import Segment
    from verify_server.model_runner import ModelInput

    step = engine.runner.compiled
    # FlexAttention's few buckets, each warmed up; or vLLM's fine ones, whose graph of a symbolic token count was
    # warmed up at 2 and 16 tokens (besides the single token's) and served 8 without a recompile (rounds_match)
    if step.dynamic:
        assert step.buckets == (1, 2, 4, 8, 16) and {1, 2, 16} <= step.compiled
    else:
        assert step.buckets == (8, 16) and step.compiled == {8, 16}
    blocks = engine.kv.blocks.allocate(2)
    inp = ModelInput.build([5, 6, 7], [Segment(tuple(blocks), 0, 3, 3, 4)], [0, 1, 2])
    tokens, positions, rows, logit_rows = step.inputs[8]
    plans = step.attention_plans(inp.segments, 8)
    # explain() resets dynamo's caches and traces body's code again: a later call of any compiled step recompiles,
    # so each engine's test of it comes after the others that use the engine
    with torch.inference_mode():
        explained = torch._dynamo.explain(step.body)(tokens, positions, rows, logit_rows, plans, step.caches)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    engine.kv.blocks.free(blocks)


def test_the_compiled_step_traces_whole(engine):
    assert engine.runner.compiled.attention == "segments"  # auto on a CPU: the runner's attention, one op
    traces_whole(engine)


def test_the_flex_compiled_step_traces_whole(flex_engine):
    traces_whole(flex_engine[1])
