"""The benchmarks' replayed devices and closed-loop load against a real server of a tiny random target, and the
replayed-load commands end to end."""

import asyncio
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from edge_client.policy import DraftPolicy
from tests.conftest import run

pytestmark = pytest.mark.model
BIN = Path(sys.executable).parent


def test_synthesized_drafts_verify_to_the_targets_own_greedy_text(tiny_server, tokenizer):
    from edge_client.generation import generate
    from edge_client.request import Request
    from edge_client.transport import VerifierClient
    from bench.replay import ReplayDrafter, greedy_outputs, synthesize_tables
    from bench.runner import prompts

    server = tiny_server
    ids = prompts(tokenizer, 3)
    fulls = greedy_outputs(server.address, tokenizer, ids, 24)
    assert all(len(f) == len(i) + 24 for f, i in zip(fulls, ids))
    tables = synthesize_tables(fulls, [len(i) for i in ids], 0.7, tokenizer.vocab_size)
    # The synthesized drafts agree with the greedy output at about the asked rate.
    pairs = [(tok, full[n + j]) for table, full in zip(tables, fulls) for n, draft in table.items()
             for j, tok in enumerate(draft)]
    assert 0.6 < sum(a == b for a, b in pairs) / len(pairs) < 0.8

    async def sled():
        client = VerifierClient(server.address)
        try:
            return await asyncio.gather(
                *[
                    generate(
                        client,
                        ReplayDrafter(t, 0.0, f),
                        tokenizer,
                        Request(i, max_tokens=24, policy=DraftPolicy(draft_tokens=4, adaptive=False)),
                    )
                    for t, f, i in zip(tables, fulls, ids)
                ]
            )
        finally:
            await client.close()

    results = run(sled())
    for result, full, prompt in zip(results, fulls, ids):
        assert result.token_ids == full[len(prompt):]
    accepted = sum(r.accepted_tokens for r in results)
    drafted = sum(r.draft_tokens for r in results)
    assert 0 < accepted < drafted


def test_closed_loop_window_counts_only_what_is_committed_inside_it(tiny_server, tokenizer):
    from bench.load import run_window, summarize
    from bench.replay import ReplayDrafter, greedy_outputs, synthesize_tables
    from bench.runner import prompts

    ids = prompts(tokenizer, 3)
    fulls = greedy_outputs(tiny_server.address, tokenizer, ids, 8)
    tables = synthesize_tables(fulls, [len(i) for i in ids], 0.8, tokenizer.vocab_size)
    t0 = time.perf_counter()
    w = run(run_window(tiny_server.address, tokenizer, lambda p: ReplayDrafter(tables[p], 0.002, fulls[p]), ids, 2,
                       8, DraftPolicy(draft_tokens=4, adaptive=False), 0.3, 1.0))
    # Each device ran requests back to back, taking the prompts in turn, and every one is the target's own text.
    assert len(w.results) > 2 * len(ids)
    by_prompt = {tuple(i): f for i, f in zip(ids, fulls)}
    for r in w.results:
        full = by_prompt[tuple(r.prompt_token_ids)]
        assert r.token_ids == full[len(r.prompt_token_ids):len(r.prompt_token_ids) + len(r.token_ids)]
    # Only rounds committed inside the window count, and the rates are their tokens over its length.
    assert w.opened_s >= 0.3
    opened = t0 + w.opened_s
    times = [t for dev in w.rounds for t, _, _ in dev]
    assert times and opened <= min(times) and max(times) < opened + 1.0 + 0.05
    inside = sum(tok for dev in w.rounds for _, tok, _ in dev)
    assert inside < sum(len(r.token_ids) for r in w.results)
    row = summarize("sled", 2, w)
    assert row["system_tokens_per_s"] == pytest.approx(inside / 1.0)
    assert row["per_device_tokens_per_s"] == pytest.approx(inside / 2)
    assert w.after.steps > w.before.steps
    # The step that verified each counted round, as its verdict said: one per round, 2 devices at most a step, and
    # counted once over its sessions' verdicts, so no more steps than the server ran in the window (its steps that
    # only prefilled, or whose rounds were committed just outside it, are not among them).
    assert len(w.steps) == sum(len(dev) for dev in w.rounds)
    assert all(tokens >= 1 and ms > 0 and 1 <= sessions <= 2 for tokens, ms, sessions in w.steps)
    seen = sum(weight for _, weight, _ in row["server_step_sizes"])
    assert 0 < seen <= w.after.steps - w.before.steps
    # and the devices' reply to the verdict before each of those rounds: the finishing of a token drafted ahead is
    # part of it
    assert len(w.replies) == len(w.steps)
    reply, drafting = row["device_reply_ms"], row["device_reply_drafting_ms"]
    assert 0 < reply[0] <= reply[1] and 0 <= drafting[0] <= drafting[1] and drafting[0] <= reply[0]
    # and each device's drafting in the window: busy part of it, idle around requests' ends (8-token requests back
    # to back) part of the rest
    assert len(w.drafting) == 2 and all(spans and ends for spans, ends in w.drafting)
    busy, ends = row["drafting_busy_share"], row["drafting_idle_at_request_ends_share"]
    assert 0 < busy < 1 and 0 < ends <= 1 - busy


def test_the_window_opens_only_once_every_device_has_committed(tiny_server, tokenizer):
    """A device whose first round comes late (its prompt's prefill outlasted the warm-up, at many devices) keeps the
    window shut: opening it on time would count a start-up phase as the steady load."""
    from bench.load import run_window
    from bench.replay import ReplayDrafter, greedy_outputs
    from bench.runner import prompts

    ids = prompts(tokenizer, 2)
    fulls = greedy_outputs(tiny_server.address, tokenizer, ids, 8)
    tables = [{n: full[n:n + 4] for n in range(len(i), len(full))} for i, full in zip(ids, fulls)]
    late = {"first": True}

    class LateStart(ReplayDrafter):
        def propose(self, context, k, stop=None):
            if late.pop("first", False):
                time.sleep(0.8)
            return super().propose(context, k, stop)

    def make(p):
        return (LateStart if p == 1 else ReplayDrafter)(tables[p], 0.002, fulls[p])

    t0 = time.perf_counter()
    w = run(run_window(tiny_server.address, tokenizer, make, ids, 2, 8, DraftPolicy(draft_tokens=4, adaptive=False),
                       0.1, 0.5))
    assert w.opened_s >= 0.8
    times = [t for dev in w.rounds for t, _, _ in dev]
    assert all(dev for dev in w.rounds)  # both devices committed inside the window
    assert min(times) >= t0 + w.opened_s


def test_a_request_the_window_ended_before_it_reached_the_server_is_not_counted(tiny_server, tokenizer):
    """A request that starts just before the window's end and is stopped before its Open (its drafter's set-up outlasted
    the window) never reached the server: it is not one of the window's requests."""
    from bench.load import run_window
    from bench.replay import ReplayDrafter, greedy_outputs
    from bench.runner import prompts

    ids = prompts(tokenizer, 1)
    fulls = greedy_outputs(tiny_server.address, tokenizer, ids, 8)
    table = {n: fulls[0][n:n + 4] for n in range(len(ids[0]), len(fulls[0]))}
    made = []

    class SlowSetUp(ReplayDrafter):
        def begin(self, context, sampling=None):
            if made.index(self):  # every request after the first sets up past the window's end
                time.sleep(1.0)
            return super().begin(context, sampling)

    def make(p):
        made.append(SlowSetUp(table, 0.0, fulls[0]))
        return made[-1]

    w = run(run_window(tiny_server.address, tokenizer, make, ids, 1, 8, DraftPolicy(draft_tokens=4, adaptive=False),
                       0.1, 0.5))
    assert len(made) == 2  # the second request started inside the window and was stopped at its end
    assert len(w.results) == 1 and w.results[0].token_ids


def test_over_a_link_sled_pays_the_round_trip_each_round_and_server_only_once_a_request(tiny_server, tokenizer):
    """sled-bench system --link: every device reaches the server through the relay process (25 ms each way here). A SLED
    device pays the round trip each round. A server-only device pays it once a request, for its Open: the server
    decodes and streams every token (Open.server_decodes), so the tokens come at the server's pace, as on loopback.
    The window records the CPU the relay took."""
    from edge_client.drafters import create_drafter
    from sim.linkemu import LinkProcess, LinkSpec
    from bench.load import run_window
    from bench.replay import ReplayDrafter, greedy_outputs, synthesize_tables
    from bench.runner import prompts

    ids = prompts(tokenizer, 2)
    fulls = greedy_outputs(tiny_server.address, tokenizer, ids, 8)
    tables = synthesize_tables(fulls, [len(i) for i in ids], 1.0, tokenizer.vocab_size)
    host, _, port = tiny_server.address.rpartition(":")

    def rounds(w):
        return sorted(seconds for dev in w.rounds for _, _, seconds in dev)

    def server_only(link=None):
        return run(run_window(tiny_server.address, tokenizer, lambda p: create_drafter("none"), ids, 2, 8,
                              DraftPolicy(0), 0.2, 0.8, link=link))

    loopback = server_only()
    relay = LinkProcess(LinkSpec(delay_ms=25), host, int(port))
    relay.start()
    try:
        linked = server_only(relay)
        sled = run(run_window(tiny_server.address, tokenizer, lambda p: ReplayDrafter(tables[p], 0.0, fulls[p]), ids,
                              2, 8, DraftPolicy(draft_tokens=4, adaptive=False), 0.2, 0.8, link=relay))
    finally:
        relay.stop()
    assert all(dev for dev in linked.rounds) and all(dev for dev in sled.rounds)  # all committed through their links
    assert rounds(sled)[0] >= 0.05  # every SLED round: a draft out and its verdict back
    # server-only: each request's Open pays the round trip, and its tokens then stream
    assert all(r.elapsed_s >= 0.05 for r in linked.results)
    # its tokens come a step apart, as on loopback: the link adds less than half its round trip to their gap
    over_link, on_loopback = (rounds(w)[len(rounds(w)) // 2] for w in (linked, loopback))
    assert over_link - on_loopback < 0.025
    assert all(t == 1 for dev in linked.rounds for _, t, _ in dev)  # a token a verdict
    assert linked.link_cpu is not None and linked.link_cpu >= 0 and loopback.link_cpu is None
    assert relay.relayed.startswith("relayed ") and int(relay.relayed.split()[1]) > 0


def test_match_rate_counts_each_drafted_token_after_a_right_prefix():
    """What --match-only measures: P(drafted token = target's greedy token | the draft's tokens before it were)."""
    from bench.replay import match_rate

    full = [1, 2, 3, 4, 5, 6]
    tables = [{2: [3, 4, 9, 6], 3: [7, 5, 6], 5: [6, 8]}]  # right, right, wrong | wrong | right, past the end
    overall, by_position = match_rate(tables, [full])
    # seen: position 0 three times (3, 7, 6), position 1 once (4; the 8 is past the end of full), position 2 once (9)
    assert overall == pytest.approx(3 / 5)
    assert by_position[:3] == pytest.approx([2 / 3, 1 / 1, 0 / 1])




def match_file(tmp_path) -> Path:
    """What --match-only writes: the match and the drafter's speed and prefill, which stand for the devices' when none
    is given."""
    match = tmp_path / "match.json"
    match.write_text(json.dumps({"draft_match": 0.9, "by_position": [0.9], "drafting_ms_per_token": 10.0,
                                 "prefill_ms_per_token": 2.0, "recordings": 8, "max_tokens": 64,
                                 "machine": "a test host", "date": "2026-11-24 00:00 UTC"}))
    return match


# a GPU's step profile emulated on the tiny target: every forward padded to 5 ms + 0.5 ms a token; the fused step's
# threshold set, not timed at start-up (a busy host can time the tiny model's fused step as never faster)
TINY = ["--target", "random:llama-tiny", "--recordings", "2", "--max-tokens", "16", "--warmup-s", "0.3",
        "--min-step-ms", "5", "--min-step-ms-per-token", "0.5", "--server-arg=--fused-max-tokens=48"]


def test_sled_bench_system_runs_end_to_end_and_writes_its_section(tmp_path):
    md, rows_path, plots = tmp_path / "bench.md", tmp_path / "rows.json", tmp_path / "plots"
    md.write_text("# Benchmarks\n\n## Engine speed: kept\n\nother section\n")
    done = subprocess.run([BIN / "sled-bench", "system", *TINY, "--draft-match", str(match_file(tmp_path)),
                           "--devices", "1", "--seconds", "1.5", "--repeats", "1", "--markdown", str(md),
                           "--json", str(rows_path), "--plots", str(plots)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(rows_path.read_text())
    assert {r["mode"] for r in rows} == {"sled", "server-only", "device-only", "sled-k2", "sled-k4", "sled-k8",
                                         "sled-no-ahead"}
    for r in rows:
        for key in ("mode", "devices", "system_tokens_per_s", "per_device_tokens_per_s", "p50_inter_token_ms",
                    "p95_inter_token_ms", "acceptance_rate"):
            assert key in r, (r["mode"], key)
    sled = next(r for r in rows if r["mode"] == "sled")
    assert sled["devices"] == 1 and sled["system_tokens_per_s"] > 0 and 0 < sled["acceptance_rate"] <= 1
    # the floor reached the server: no step, of either mode, was quicker than it
    assert all(r["server_step_ms"] >= 5.0 for r in rows if r["mode"] in ("sled", "server-only")), rows
    assert sled["drafting_ms_per_token"] >= 10.0 - 1e-6  # the drafting speed the match file recorded
    text = md.read_text()
    assert "## Engine speed: kept\n\nother section" in text  # another benchmark's section is left as it was
    assert "## System benchmark: SLED vs server-only vs device-only" in text
    assert "- emulated GPU step profile: every forward padded to 5 ms + 0.5 ms a token" in text
    assert ("synthesized from the target's greedy output, each position right with probability 0.900 (the real "
            "pair's match, measured on a test host at 2026-11-24 00:00 UTC over 8 greedy outputs); devices draft at "
            "10.00 ms/token (the real drafter's, measured with the match) and spend 2.00 ms a prompt token") in text
    assert re.search(r"server kernels: cpu float32, sdpa attention, \w+ linear; the fused CPU step for steps of up "
                     r"to 48 tokens", text)
    assert "| 1 | sled |" in text and "| 1 | server-only |" in text and "| 1 | device-only |" in text
    assert "capacity (the largest count here with p95 inter-token latency" in text
    assert sorted(p.name for p in plots.iterdir()) == [
        "system_p95_inter_token_ms.png",
        "system_system_tokens_per_s.png",
    ]
    assert "(plots/system_p95_inter_token_ms.png)" in text  # linked from the section, relative to it


def test_sled_bench_capacity_raises_the_count_until_the_target_and_names_what_stopped_it(tmp_path):
    """On the tiny target with steps padded to 5 ms + 0.5 ms a token, server-only's TPOT is at least a step; the
    counts tried (1, 2, 4) all pass for both modes at a loose target, and at a tight one (a TPOT of 1 ms, below any
    step) none does: every mode stops at the target at the first count."""
    md, out = tmp_path / "bench.md", tmp_path / "capacity.json"
    common = [BIN / "sled-bench", "capacity", *TINY, "--draft-match", str(match_file(tmp_path)), "--seconds", "1",
              "--repeats", "1", "--markdown", str(md), "--plots", str(tmp_path / "plots")]
    done = subprocess.run([*common, "--devices", "1,2,4", "--slo-tpot-ms", "1000", "--slo-ttft-ms", "60000", "--json",
                           str(out)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert {(r["mode"], r["devices"]) for r in got["rows"]} == {(m, n) for m in ("sled", "server-only")
                                                                for n in (1, 2, 4)}
    caps = {c["mode"]: c for c in got["capacity"]}
    assert set(caps) == {"sled", "server-only"}
    for c in caps.values():
        assert set(c) == {"mode", "devices", "system_tokens_per_s", "bound", "slo"}
        assert c["devices"] == 4 and c["bound"] == "largest count tried" and c["system_tokens_per_s"] > 0
        assert c["slo"] == {"p95_tpot_ms": 1000.0, "p95_ttft_ms": 60000.0}
    for r in got["rows"]:  # every count timed whole requests; server-only's TPOT is at least the padded step (a
        # SLED round commits several tokens in one step, so its TPOT may be below it)
        assert r["requests_timed"] > 0 and 0 < r["p50_tpot_ms"] <= r["p95_tpot_ms"] and r["p95_ttft_ms"] > 0
        assert r["mode"] == "sled" or r["p50_tpot_ms"] >= 5.0
        assert {"p50_inter_token_ms", "p95_inter_token_ms", "system_tokens_per_s"} <= set(r)
    text = md.read_text()
    assert "## Capacity at a latency target" in text and "| sled | 4 |" in text and "largest count tried" in text
    done = subprocess.run([*common, "--devices", "1,2", "--slo-tpot-ms", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert all(c["devices"] == 0 and c["bound"] == "slo" for c in got["capacity"])
    assert {r["devices"] for r in got["rows"]} == {1}  # no mode met the target: the count stopped rising


def test_a_requests_ttft_and_tpot_follow_vllms_definitions():
    from bench.load import latency_figures, request_latency

    # asked at 10.0; rounds commit at 10.3 (first tokens), 10.5 and 10.9; 9 tokens in all
    ttft, tpot = request_latency(10.0, [10.3, 10.5, 10.9], 9)
    assert ttft == pytest.approx(0.3) and tpot == pytest.approx(0.6 / 8)  # (e2e 0.9 − TTFT 0.3) / (9 − 1)
    assert math.isnan(request_latency(10.0, [10.3], 1)[1])  # one token: no TPOT
    figures = latency_figures([(0.3, 0.075), (0.1, 0.025), (0.2, float("nan"))])
    assert figures["requests_timed"] == 3 and figures["p50_tpot_ms"] == pytest.approx(50.0)
    assert figures["p95_ttft_ms"] == pytest.approx(np.percentile([300, 100, 200], 95))
    empty = latency_figures([])
    assert empty["requests_timed"] == 0 and math.isnan(empty["p95_tpot_ms"])
