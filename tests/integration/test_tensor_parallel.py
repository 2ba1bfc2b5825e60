"""Tensor parallelism on the CPU (gloo): a server whose target is split over two ranks gives the verdicts one rank
gives, on the same drafts, greedy and with seeded sampling; its ranks stop with it; a rank that dies takes it to
NOT_SERVING and out, with a log line that names the rank, never a hang."""

import asyncio
import json
import os
import signal
import subprocess
import time

import numpy as np
import psutil
import pytest
import torch

from sim.processes import BIN, free_port
from edge_client import codec
from edge_client.drafters.base import Proposal
from edge_client.request import Request
from edge_client.sampling import SamplingParams
from edge_client.transport import VerifierClient, VerifyError

pytestmark = pytest.mark.model

# A small Llama left as initialised (no stabilize()): its greedy text varies and sampling from it is not one-hot.
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, tie_word_embeddings=False, stabilize=False)
PROMPT = [1, 504, 3458, 314, 1345, 30, 1073, 2117, 7050, 28, 2683, 359]


def start(spec: str, tp: int, log_path, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    with open(log_path, "w") as out:
        proc = subprocess.Popen([BIN / "sled-server", "--target", spec, "--device", "cpu", "--port", str(port),
                                 "--tensor-parallel", str(tp), "--max-sessions", "4", "--max-seq-len", "128",
                                 "--seed", "0", *extra], stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while "ready on" not in log_path.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
        time.sleep(0.3)
    return proc, f"127.0.0.1:{port}"


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=60)


async def session_verdicts(address: str, fingerprint: str, sampling: SamplingParams, drafts) -> list[tuple]:
    """Open a session and send `drafts(committed)` each round until it finishes: every verdict's (accepted, next)."""
    client = VerifierClient(address)
    try:
        session = await client.open(codec.open_message(Request(PROMPT, 24, sampling), fingerprint), timeout=60)
        committed, out = [], []
        for round_ in range(40):
            proposal = drafts(committed)
            verdict = await session.verify(round_, proposal)
            out.append((verdict.n_accepted, verdict.next_token))
            committed += proposal.token_ids[:verdict.n_accepted]
            if verdict.next_token is not None:
                committed.append(verdict.next_token)
            if verdict.finished:
                break
        await session.close()
        return out
    finally:
        await client.close()


@pytest.mark.parametrize("source", ["random", "folder"])
def test_two_ranks_give_the_verdicts_of_one(tmp_path, source):
    """source folder: the same weights saved as safetensors, from which each rank reads only its slices."""
    from verify_server.model_loader import load_target, save_folder

    spec_path = tmp_path / "shape.json"
    spec_path.write_text(json.dumps(SHAPE))
    spec = f"random:{spec_path}"
    target = load_target(spec, torch.device("cpu"), torch.float32)
    if source == "folder":
        spec = str(tmp_path / "target")
        (tmp_path / "target").mkdir()
        save_folder(target.model, target.tokenizer, tmp_path / "target")
    with torch.inference_mode():
        greedy = target.model.generate(torch.tensor([PROMPT]), max_new_tokens=40, do_sample=False,
                                       pad_token_id=0)[0, len(PROMPT):].tolist()
    assert len(set(greedy)) > 5  # not a constant text: drafts of it are accepted and rejected in turn

    def greedy_drafts(committed):  # the target's own continuation, every third token wrong
        at = len(committed)
        return Proposal([t if (at + i) % 3 else (t + 1) % 49152 for i, t in enumerate(greedy[at:at + 4])])

    # Fixed drafts with their q, the same for both servers. The target's distribution is nearly flat over 49,152
    # tokens, so each drafted token gets a q of the same order (1e-5) and is accepted about as often as not.
    rng = np.random.default_rng(0)
    sampled_rounds = []
    for _ in range(40):
        tokens = [int(t) for t in rng.integers(0, 49152, 3)]
        sampled_rounds.append(Proposal(tokens, [np.array([t, (t + 7) % 49152], dtype=np.int64) for t in tokens],
                                       [np.array([1e-5, 1 - 1e-5], dtype=np.float32) for _ in tokens]))

    def sampled_drafts(committed):
        return sampled_rounds[min(len(committed), 39)]

    runs = {}
    for tp in (1, 2):
        proc, address = start(spec, tp, tmp_path / f"tp{tp}.log")
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)
                 if "spawn_main" in " ".join(p.cmdline())]
        try:
            assert len(ranks) == tp - 1  # rank 0 is the server itself
            runs[tp] = (asyncio.run(session_verdicts(address, target.fingerprint, SamplingParams(), greedy_drafts)),
                        asyncio.run(session_verdicts(address, target.fingerprint,
                                                     SamplingParams(temperature=0.9, seed=11), sampled_drafts)))
        finally:
            assert stop(proc) == 0
        log = (tmp_path / f"tp{tp}.log").read_text()
        if tp == 2:
            assert "tensor parallel: 2 ranks ready (gloo)" in log
            if source == "folder":  # both ranks read their slices alone
                assert "rank 0 of 2: reading its slices" in log and "rank 1 of 2: reading its slices" in log
        _, alive = psutil.wait_procs(ranks, timeout=30)
        assert not alive  # the server stopped its ranks with it
    greedy_1, sampled_1 = runs[1]
    greedy_2, sampled_2 = runs[2]
    assert greedy_1 == greedy_2 and sampled_1 == sampled_2
    accepted = [n for n, _ in greedy_1]
    assert max(accepted) >= 2 and min(accepted) == 0  # drafts accepted and rejected
    assert sum(n for n, _ in sampled_1) >= 1 and len({t for _, t in sampled_1}) > 3  # sampling, not one token


def test_a_rank_that_dies_takes_the_server_out_with_its_reason(tmp_path):
    spec_path = tmp_path / "shape.json"
    spec_path.write_text(json.dumps(SHAPE))
    log_path = tmp_path / "tp.log"
    proc, address = start(f"random:{spec_path}", 2, log_path)
    try:
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.is_running()]
        worker = next(p for p in ranks if "spawn_main" in " ".join(p.cmdline()))
        os.kill(worker.pid, signal.SIGKILL)
        assert proc.wait(timeout=90) == 1  # out, never hanging
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = log_path.read_text()
    assert f"tensor-parallel rank 1 (pid {worker.pid}) exited with code -9" in log and "NOT_SERVING" in log

    async def refused():
        client = VerifierClient(address)
        try:
            await client.info(timeout=2)
        finally:
            await client.close()

    with pytest.raises(VerifyError):
        asyncio.run(refused())


def test_a_split_the_shape_does_not_allow_is_refused_at_start(tmp_path):
    spec_path = tmp_path / "shape.json"
    spec_path.write_text(json.dumps(SHAPE))
    done = subprocess.run([BIN / "sled-server", "--target", f"random:{spec_path}", "--device", "cpu", "--port",
                           str(free_port()), "--tensor-parallel", "3", "--max-sessions", "2", "--max-seq-len", "64"],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 1
    assert "tensor_parallel 3 does not divide the target's num_attention_heads (4)" in done.stderr
