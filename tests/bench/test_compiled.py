"""sled-bench compiled: a tiny run writes its section and rows, the three runners' logits agreeing; bad sizes and
families are argparse errors."""

import json

import pytest

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
    text = md.read_text()
    assert compiled.MARKER in text and "| llama | 2 × 3 |" in text


@pytest.mark.parametrize("flag,value", [("--sizes", "8"), ("--sizes", "0x5"), ("--families", "gpt2")])
def test_bad_sizes_and_families_are_refused(flag, value, capsys):
    with pytest.raises(SystemExit):
        compiled.build_parser().parse_args([flag, value])
    assert "error" in capsys.readouterr().err
