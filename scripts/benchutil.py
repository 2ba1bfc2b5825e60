"""What the benchmark scripts share: a real sled-server process, machine facts, docs/benchmarks.md sections."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from scripts.ports import free_port

BIN = Path(sys.executable).parent


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


class TransformersTokenizer:
    """The default GGUF's tokenizer through transformers, for benchmark runs where llama.cpp is not installed
    (a GPU machine): what the benchmarks and `generate` use of the device's tokenizer, same ids and fingerprint."""

    def __init__(self, folder: str | None = None):
        from sled.v1.fingerprint import vocab_fingerprint
        from verify_server.model_loader import vocab_tokens, vocabulary_tokenizer

        self._tok = vocabulary_tokenizer(folder)
        self.vocab_size = len(self._tok)
        self.eos_token_id = self._tok.eos_token_id
        self.fingerprint = vocab_fingerprint(vocab_tokens(self._tok))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids)

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def stream_decoder(self) -> "_CumulativeDecoder":
        return _CumulativeDecoder(self)


class _CumulativeDecoder:
    def __init__(self, tokenizer: TransformersTokenizer):
        self._tok, self._ids, self._text = tokenizer, [], ""

    def feed(self, token_ids: list[int]) -> str:
        self._ids += token_ids
        text = self._tok.decode(self._ids)
        if text.endswith("\ufffd"):  # a split UTF-8 sequence: wait for the rest
            return ""
        new, self._text = text[len(self._text):], text
        return new

    def flush(self) -> str:
        text = self._tok.decode(self._ids)
        new, self._text = text[len(self._text):], text
        return new


def counts_arg(text: str) -> list[int]:
    """An argparse type: comma-separated whole numbers, each at least 1 (device or session counts)."""
    import argparse

    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated whole numbers, got {text!r}") from None
    if min(counts) < 1:
        raise argparse.ArgumentTypeError(f"counts must be at least 1, got {text!r}")
    return counts


def device_tokenizer(folder: str | None = None):
    """The device's llama.cpp tokenizer, or the same vocabulary through transformers where llama.cpp is missing or
    a tokenizer folder is given (exported from the GGUF by scripts/export_tokenizer.py)."""
    if folder is not None:
        return TransformersTokenizer(folder)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return TransformersTokenizer()
    from edge_client.tokenizer import Tokenizer

    return Tokenizer()


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


def exit_on_sigterm() -> None:
    """SIGTERM (`kill`, a job stopped by its runner) raises SystemExit in the main thread, as Ctrl-C raises
    KeyboardInterrupt, so that `finally` blocks and `with` exits run: a killed benchmark stops the server it
    started instead of leaving it on the cores. A handler the program set itself is kept."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


class ServerProcess:
    """`with ServerProcess("--max-sessions", "8") as address:` a real sled-server on a free loopback port."""

    def __init__(self, *flags: str, timeout: float = 300):
        self.flags, self.timeout = flags, timeout
        self.port = free_port()
        self.log = Path(tempfile.mkdtemp(prefix="sled-bench-")) / "server.log"

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> str:
        exit_on_sigterm()
        print(f"[bench] starting sled-server on port {self.port} (log {self.log})", flush=True)
        with open(self.log, "w") as out:
            # The installed entry point, or the module where SLED runs from a checkout (a GPU node without the venv).
            command = [str(BIN / "sled-server")] if (BIN / "sled-server").exists() else [sys.executable, "-m",
                                                                                         "verify_server.cli"]
            self.proc = subprocess.Popen([*command, "--port", str(self.port), *self.flags],
                                         stdout=out, stderr=subprocess.STDOUT)
        start = time.time()
        while "ready on" not in self.log.read_text():
            if self.proc.poll() is not None or time.time() - start > self.timeout:
                self.proc.kill()
                raise RuntimeError(f"sled-server did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(1)
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
