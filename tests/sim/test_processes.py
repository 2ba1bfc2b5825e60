"""The benchmarks' shared parts: a benchmark killed with SIGTERM still runs its `finally` blocks (which stop its
server); rewriting a docs section names the hand notes it drops; device counts are checked."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench.cli import counts_arg

SCRIPT = """
import time
from sim.processes import exit_on_sigterm
if {install}:
    exit_on_sigterm()
try:
    print("ready", flush=True)
    time.sleep(60)
finally:
    open({marker!r}, "w").write("cleaned up")
"""


def killed(tmp_path: Path, install: bool) -> tuple[int, bool]:
    marker = tmp_path / f"marker-{install}"
    with subprocess.Popen([sys.executable, "-c", SCRIPT.format(install=install, marker=str(marker))],
                          stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=30), marker.exists()


def test_sigterm_runs_finally_blocks_with_the_handler_and_not_without(tmp_path):
    assert killed(tmp_path, install=True) == (128 + signal.SIGTERM, True)
    # Python's default: the process dies at once and the cleanup never runs (what left servers behind)
    assert killed(tmp_path, install=False) == (-signal.SIGTERM, False)


def test_rewriting_a_section_names_the_hand_notes_it_drops(tmp_path, capsys):
    from bench.report import replace_section

    md = tmp_path / "benchmarks.md"
    note = "- note, added after the run: the second pass ran on a slower host"
    md.write_text("# Benchmarks\n\n## Engine speed\n\n- date: 1\n" + note + "\n\n### Step\n\n- x\n\n## Other\n\n- kept\n")
    dropped = replace_section(md, "## Engine speed", "## Engine speed\n\n- date: 2\n")
    assert dropped == [note]
    assert note in capsys.readouterr().out
    text = md.read_text()
    assert note not in text and "- date: 2" in text and "- date: 1" not in text and "## Other\n\n- kept" in text
    # a note the new section carries itself is not reported, nor are other sections' notes
    md.write_text("## A\n\n" + note + "\n\n## B\n\n" + note + "\n")
    assert replace_section(md, "## A", "## A\n\n" + note + "\n") == []
    assert md.read_text().count(note) == 2


def test_device_counts_are_positive_whole_numbers():
    assert counts_arg("1,4,16,32") == [1, 4, 16, 32] and counts_arg("8") == [8]
    for bad in ("", "0", "1,-4", "a,b", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            counts_arg(bad)
