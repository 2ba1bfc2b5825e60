"""sled-bench: every benchmark has help; the soak and fairness commands run end to end and report what they check."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.cli import COMMANDS

BIN = Path(sys.executable).parent


def bench(*args, timeout=900):
    return subprocess.run([BIN / "sled-bench", *args], capture_output=True, text=True, timeout=timeout)


def test_sled_bench_lists_its_benchmarks_and_refuses_an_unknown_one():
    done = bench("--help")
    assert done.returncode == 0 and all(name in done.stdout for name in COMMANDS)
    done = bench("nope")
    assert done.returncode == 2 and "no benchmark 'nope'" in done.stderr


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_benchmark_has_help(name):
    done = bench(name, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: sled-bench {name}")


@pytest.mark.model
def test_the_soak_kills_and_restarts_the_server_and_loses_nothing():
    done = bench("soak", "--seconds", "12", "--devices", "8", "--kill-every", "6", "--down-s", "1",
                 "--malformed-per-s", "10", "--no-markdown")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "SIGKILL to the server" in out and "| server lives (kills and drains + 1) | 2 |" in out
    assert "| tokens lost (finished texts not the target's greedy text) | 0 |" in out
    assert "| KV slots leaked after the run | 0 |" in out
    assert "| malformed calls answered INTERNAL or UNKNOWN | 0 |" in out
    assert "[soak] PASS" in out


@pytest.mark.model
def test_fairness_compares_chunk_sizes_side_by_side():
    done = bench("fairness", "--target", "random:llama-tiny", "--chunks", "512,auto", "--seconds", "1",
                 "--repeats", "1", "--light", "2", "--heavy", "2", "--prompt-tokens", "200", "--ttft-tokens", "100",
                 "--ttft-prompts", "1", "--no-markdown")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 512 |") or line.startswith("| auto |")]
    assert len(rows) == 4 and all(row.count("|") == 8 for row in rows)  # both tables, a row per setting
    assert all("nan" not in row for row in rows)  # every phase measured something
    assert "TTFT alone, median ms" in done.stdout and "prompts a minute" in done.stdout
    long_rows = rows[2:]  # each beside the ceiling that one prompt alone measured
    assert all(re.search(r"\| \d+\.\d \(\d+\.\d\d of \d+\.\d\) \|", row) for row in long_rows), long_rows
