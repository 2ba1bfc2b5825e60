"""sled-bench compiled: a tiny run writes its section and rows, the three runners' logits agreeing; bad sizes and
families are argparse errors."""

import json
from types import SimpleNamespace

import pytest
import torch

from bench import compiled


def test_a_tiny_run_writes_its_section_with_every_runner(tmp_path):
    md, rows_file = tmp_path / "b.md", tmp_path / "rows.json"
    args = compiled.build_parser().parse_args(["--families", "llama", "--sizes", "1x1,2x3", "--layers", "1",
                                               "--hidden", "64", "--context", "20", "--steps", "1", "--rounds", "1",
                                               "--markdown", str(md), "--json", str(rows_file)])
    assert compiled.main(args) == 0
    rows = json.loads(rows_file.read_text())
    assert [(r["sessions"], r["tokens"]) for r in rows] == [(1, 1), (2, 3)]
    assert all(r["eager_ms"] > 0 and r["fused_ms"] > 0 and r["compiled_ms"] > 0 for r in rows)
    assert all(r["max_logit_difference"] < 1e-3 for r in rows)  # the three runners compute the same step
    assert all(r["projections_ms"] > 0 and r["eager_over_projections"] == r["eager_ms"] / r["projections_ms"]
               for r in rows)
    # the floor is a roofline of the step's work, which grows with its tokens (set against a runner's time it would
    # compare two timings, which a loaded machine can turn either way): the projections' multiply-adds with every
    # token, the bytes with the sessions' KV (the weights are read once either way)
    assert rows[1]["flop"] == 6 * rows[0]["flop"]
    kv_token = 2 * 1 * 1 * 64 * 4  # K and V of 1 layer, 1 KV head of 64, float32
    assert rows[1]["bytes"] - rows[0]["bytes"] == kv_token * (2 * (20 + 3) - (20 + 1))
    for r in rows:
        compute, memory = r["flop"] / r["flop_per_s"], r["bytes"] / r["copy_bytes_per_s"]
        assert r["floor_ms"] == pytest.approx(max(compute, memory) * 1000)
        assert r["floor_bound"] == ("compute" if compute >= memory else "memory")
    for r in rows:  # the runner keeps the faster of its fused and compiled steps
        assert r["eager_over_best"] == r["eager_ms"] / min(r["fused_ms"], r["compiled_ms"])
    text = md.read_text()
    assert compiled.MARKER in text and "| llama | 2 × 3 |" in text
    assert f"- 2 × 3, eager over the faster of the fused and compiled steps: llama {rows[1]['eager_over_best']:.2f}x" \
        in text


def test_projections_run_every_projection_of_the_step_at_its_rows():
    """The projections alone: each layer's four groups over the step's rows at their own input widths, and the LM
    head over the logit rows, through the runner's own callables."""
    calls = []

    def project(name):
        return lambda x: calls.append((name, tuple(x.shape))) or (x,)

    def linear(width):
        return SimpleNamespace(in_features=width)

    layer = SimpleNamespace(self_attn=SimpleNamespace(q_proj=linear(8), o_proj=linear(12)),
                            mlp=SimpleNamespace(gate_proj=linear(8), down_proj=linear(20)))
    runner = SimpleNamespace(layers=[layer, layer], dtype=torch.float32, lm_head=torch.zeros(50, 8),
                             proj=[tuple(project(f"{i}.{g}") for g in ("qkv", "o", "gate_up", "down")) for i in (0, 1)],
                             head=lambda x: calls.append(("head", tuple(x.shape))))
    inp = SimpleNamespace(token_ids=torch.zeros(6, dtype=torch.long), logit_rows=torch.arange(4))
    compiled.Projections(runner).forward(inp)
    assert calls == [(f"{i}.{g}", (6, w)) for i in (0, 1) for g, w in (("qkv", 8), ("o", 12), ("gate_up", 8),
                                                                       ("down", 20))] + [("head", (4, 8))]


@pytest.mark.parametrize("flag,value", [("--sizes", "8"), ("--sizes", "0x5"), ("--families", "gpt2")])
def test_bad_sizes_and_families_are_refused(flag, value, capsys):
    with pytest.raises(SystemExit):
        compiled.build_parser().parse_args([flag, value])
    assert "error" in capsys.readouterr().err
