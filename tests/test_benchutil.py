"""scripts/benchutil.py: a benchmark killed with SIGTERM still runs its `finally` blocks (which stop its server)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import sys, time
sys.path.insert(0, {root!r})
from scripts.benchutil import exit_on_sigterm
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
    with subprocess.Popen([sys.executable, "-c", SCRIPT.format(root=str(ROOT), install=install, marker=str(marker))],
                          stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=30), marker.exists()


def test_sigterm_runs_finally_blocks_with_the_handler_and_not_without(tmp_path):
    assert killed(tmp_path, install=True) == (128 + signal.SIGTERM, True)
    # Python's default: the process dies at once and the cleanup never runs (what left servers behind)
    assert killed(tmp_path, install=False) == (-signal.SIGTERM, False)
