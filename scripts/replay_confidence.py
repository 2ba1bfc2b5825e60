"""Replay a real drafter's recorded drafts through the adaptive controller, with and without its confidence stop rule.

    python scripts/replay_confidence.py                                   # SmolLM2 Q4_1, the default drafter
    python scripts/replay_confidence.py --draft-model drafts/smollm2-q2k.gguf   # a weaker one (requantize_gguf.py)

Records, as the system benchmark does, the target's greedy output for each prompt (through a real sled-server) and,
at every prefix of it, the drafter's greedy proposal of 8 tokens with its confidence in each. Then replays rounds
along each output: the controller chooses K (and, with the rule on, where the draft ends), the recording says how
many tokens the target accepts, and each round is charged a modelled time. Two models: this machine's CPU server
(6 ms a round + 3.5 ms a verified token: the step's cost at 4-16 devices) and a device-bound one (30 ms a round trip +
16 ms a drafted token, verification free). Prints the time per committed token of fixed K = 1..8, of llama.cpp's
fixed minimum draft probability (0.75) at K = 8, and of the adaptive controller with and without the stop rule.
A model over recorded drafts, not a measurement of the system: scripts/bench_system.py measures that.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edge_client.adaptive import AdaptiveDraftLength, RoundSample  # noqa: E402
from scripts.bench_system import K_MAX, prompts, record_tables  # noqa: E402
from bench.processes import ServerProcess  # noqa: E402
from bench.tokenizers import device_tokenizer  # noqa: E402

MODELS = {"cpu-server": (0.006, 0.0, 0.0035), "device-bound": (0.030, 0.016, 0.0)}  # round s, draft s/token, c


def replay(recordings, model, k=None, p_min=None, confidence_stop=True, passes=2):
    """Seconds per committed token and mean drafted tokens per round, over the last of `passes` passes (the earlier
    ones warm the controller up). k: a fixed K; else the adaptive controller."""
    fixed_s, draft_s, token_s = model
    ctrl = AdaptiveDraftLength(k_max=K_MAX, k_initial=K_MAX, confidence_stop=confidence_stop)
    cost = committed = drafted = rounds = 0
    for last in [False] * (passes - 1) + [True]:
        for full, start, table, confidence in recordings:
            n = start
            while n < len(full):
                tokens, sure = table[n], confidence[n]
                kk = min(k or ctrl.k, len(tokens))  # a proposal ends early at the drafter's end of text
                rule = ctrl.stop_rule() if k is None else None
                d = made = kk
                for i in range(kk):  # the first token always goes: p_min from the second, and take() says yes
                    if (i and p_min is not None and sure[i] < p_min) or (rule is not None and not rule.take(sure[i])):
                        d, made = i, i + 1  # drafted to read its confidence, then dropped
                        break
                    if rule is not None and not rule.more():
                        d = made = i + 1
                        break
                accepted = 0
                while accepted < d and n + accepted < len(full) and tokens[accepted] == full[n + accepted]:
                    accepted += 1
                gained = min(accepted + 1, len(full) - n)
                n += gained
                rtt = fixed_s + token_s * (d + 1)
                ctrl.observe(RoundSample(d, accepted, draft_s * made, rtt, token_s, confidence=tuple(sure[:d])))
                if last:
                    cost += rtt + draft_s * made
                    committed += gained
                    drafted += d
                    rounds += 1
    return cost / committed, drafted / rounds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft-model", help="GGUF drafter (default: the SmolLM2 Q4_1 GGUF)")
    ap.add_argument("--prompts", type=int, default=16, help="chat prompts recorded (default 16)")
    ap.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt (default 64)")
    args = ap.parse_args()
    tokenizer = device_tokenizer()
    ids = prompts(tokenizer, args.prompts)
    with ServerProcess("--fused-max-tokens", "64") as address:
        print(f"[replay] recording the drafter along {len(ids)} greedy outputs ...", flush=True)
        tables, fulls, confidences = record_tables(address, tokenizer, ids, args.max_tokens, args.draft_model)
    recordings = list(zip(fulls, [len(i) for i in ids], tables, confidences))
    for name, model in MODELS.items():
        print(f"\n{name} (round {model[0] * 1e3:g} ms, drafting {model[1] * 1e3:g} ms/token, verifying "
              f"{model[2] * 1e3:g} ms/token): ms per committed token (mean drafted tokens per round)")
        fixed = {k: replay(recordings, model, k=k) for k in range(1, K_MAX + 1)}
        best = min(fixed, key=lambda k: fixed[k][0])
        rows = [(f"fixed K = {k}", *fixed[k]) for k in fixed]
        rows.append(("K = 8, llama.cpp's p_min 0.75", *replay(recordings, model, k=K_MAX, p_min=0.75)))
        off = replay(recordings, model, confidence_stop=False)
        on = replay(recordings, model)
        rows += [("adaptive, no stop rule", *off), ("adaptive with the stop rule", *on)]
        for label, s, d in rows:
            print(f"  {label:32s} {s * 1e3:6.2f} ({d:.2f})")
        print(f"  the stop rule: {on[0] / off[0]:.3f}x the adaptive controller without it, "
              f"{on[0] / fixed[best][0]:.3f}x the best fixed K ({best})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
