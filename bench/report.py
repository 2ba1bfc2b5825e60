"""What every benchmark reports beside its figures: the machine, its noise, and its section of docs/benchmarks.md."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path


def machine() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}, Python {platform.python_version()}"


def cpu_counters() -> tuple[int, int] | None:
    """This host's CPU time over all its CPUs from /proc/stat, as (stolen, total) in clock ticks, or None where
    there is none. Stolen time is what a virtual machine's CPUs were ready to run but the hypervisor ran someone
    else: on a shared host it is one visible part of the noise between benchmark runs."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if fields[0] != "cpu" or len(fields) < 9:
        return None
    ticks = [int(x) for x in fields[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice]: guest time is already in user and nice.
    return ticks[7], sum(ticks[:8])


def stolen_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of the CPU time between two cpu_counters() readings that the hypervisor took."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def gpu_name() -> str | None:
    """The first CUDA device's name, or None (also when torch is missing)."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def copy_bandwidth(mib: int = 1024, repeats: int = 5, device: str = "cpu") -> float:
    """Best STREAM-style copy bandwidth of torch on `device` (host memory, or a GPU's), bytes read + written per
    second. The buffers (1 GiB each by default) are far larger than any cache, so this is memory."""
    import torch

    def sync():
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        y.copy_(x)
        sync()
        times.append(time.perf_counter() - t0)
    return 2 * x.numel() * 4 / min(times)


HAND_NOTE = "- note, added after the run"  # how a line written by hand into a script's section begins


def replace_section(md: Path, marker: str, section: str) -> list[str]:
    """Rewrite the section of `md` that starts with `marker` (or append it), leaving the others as they are.
    Returns the hand notes (lines beginning with HAND_NOTE) that the old section had and the new one has not: they
    describe the old run's figures, so they are not carried over, but each is printed, so that a rerun does not drop
    one unseen."""
    text = md.read_text() if md.exists() else "# Benchmarks\n\nEach section is written by the script it names.\n\n"
    dropped: list[str] = []
    if marker in text:
        head, _, rest = text.partition(marker)
        nxt = rest.find("\n## ")
        old, tail = (rest[:nxt], rest[nxt:]) if nxt >= 0 else (rest, "")
        kept = section.splitlines()
        dropped = [line for line in old.splitlines() if line.startswith(HAND_NOTE) and line not in kept]
        for line in dropped:
            print(f"[bench] {md}: the old section's hand note is not carried over (it describes the old run); "
                  f"add it again if it still holds:\n{line}", flush=True)
        text = head + section + tail
    else:
        text = text.rstrip() + "\n\n" + section
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(text)
    return dropped


def publish(markdown: str | Path, marker: str, section: str, json_path: str | None, rows: list) -> None:
    """Write a script's section of docs/benchmarks.md and, when asked, its rows as JSON."""
    replace_section(Path(markdown), marker, section)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(rows, indent=2))
    print(f"[bench] wrote {markdown}" + (f" and {json_path}" if json_path else ""))
