"""sled-bench gpu-check on the CPU with a tiny shape: known to work before a GPU is lent."""

import json

from bench import gpu_check


def test_gpu_check_runs_on_the_cpu_and_writes_its_section(tmp_path):
    md, rows_file = tmp_path / "b.md", tmp_path / "rows.json"
    args = gpu_check.build_parser().parse_args(["--shapes", "random:llama-tiny", "--context", "32", "--device", "cpu",
                                                "--steps", "1", "--rounds", "1", "--markdown", str(md),
                                                "--json", str(rows_file)])
    assert gpu_check.main(args) == 0
    rows = json.loads(rows_file.read_text())
    assert [(r["sessions"], r["tokens"]) for r in rows] == [(1, 1), (32, 5)]
    for r in rows:
        assert r["greedy_agreement"] == 1.0  # the compiled step picks eager's token on every row
        assert min(r["eager_ms"], r["compiled_ms"], r["hf_static_ms"], r["floor_ms"]) > 0
    text = md.read_text()
    assert gpu_check.MARKER in text and "| random:llama-tiny | 32 × 5 |" in text
