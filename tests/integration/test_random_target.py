"""Random-weight Llama targets (GPU capacity runs): the devices' vocabulary, exact verification, a step floor."""

import time
from pathlib import Path

import pytest
import torch

from kernels.attention import Segment

pytestmark = pytest.mark.model


def test_random_target_speaks_the_devices_vocabulary(tiny, tokenizer):
    assert tiny.vocab_size == tokenizer.vocab_size == 49152
    assert tiny.fingerprint == tokenizer.fingerprint
    assert tiny.eos_token_ids == (tokenizer.eos_token_id,)
    cfg = tiny.model.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert "random weights" in tiny.name


def test_exported_tokenizer_folder_gives_the_same_vocabulary(tiny, tmp_path):
    """A GPU node without the GGUF builds the random target from the folder export_tokenizer.py writes: the devices
    (GGUF through llama.cpp) and the server must still agree on the vocabulary."""
    import subprocess
    import sys

    from verify_server.model_loader import load_target

    out = tmp_path / "tok"
    script = Path(__file__).resolve().parents[2] / "scripts" / "export_tokenizer.py"
    done = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert tiny.fingerprint in done.stdout
    from_folder = load_target("random:llama-tiny", torch.device("cpu"), torch.float32, tokenizer=out)
    assert from_folder.fingerprint == tiny.fingerprint and from_folder.vocab_tokens == tiny.vocab_tokens
    assert from_folder.eos_token_ids == tiny.eos_token_ids
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_target("random:llama-tiny", torch.device("cpu"), torch.float32, tokenizer=tmp_path / "none")
    with pytest.raises(ValueError, match="random targets only"):
        load_target(None, torch.device("cpu"), torch.float32, tokenizer=out)


def test_random_target_greedy_text_is_stable_under_rounding(tmp_path):
    """The top logit leads by far more than rounding can move (a GPU verifies in bfloat16, in batches of any
    shape). With the usual initialisation the top two logits end within a few percent of each other, the greedy
    text changed with the batch, and drafts synthesized from a recorded greedy text stopped matching it
    (acceptance 0.2 at 16 devices on an H100, for a per-position match of 0.98)."""
    from transformers import LlamaForCausalLM

    from verify_server.model_loader import load_target

    shape = tmp_path / "shape.json"
    shape.write_text('{"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4, '
                     '"num_key_value_heads": 2, "head_dim": 64, "tie_word_embeddings": true}')
    model = load_target(f"random:{shape}", torch.device("cpu"), torch.float32).model
    ids = torch.randint(0, 49152, (1, 40), generator=torch.Generator().manual_seed(3))

    def greedy(m, dtype):  # greedy tokens, and how far the top logit leads the second (relative)
        with torch.inference_mode():
            logits = m.to(dtype)(ids).logits[0].float()
        top = logits.topk(2, dim=-1).values
        return logits.argmax(-1), (top[:, 0] - top[:, 1]) / top[:, 0].abs()

    exact, lead = greedy(model, torch.float32)
    rounded, _ = greedy(model, torch.bfloat16)
    assert lead.min() > 0.3
    assert torch.equal(exact, rounded)
    assert torch.equal(exact, ids[0])  # it repeats each position's token
    torch.manual_seed(0)
    plain = LlamaForCausalLM(model.config).float().eval()
    exact, lead = greedy(plain, torch.float32)
    rounded, _ = greedy(plain, torch.bfloat16)
    assert lead.median() < 0.1 and not torch.equal(exact, rounded)  # what stabilize() is for


def test_runner_matches_transformers_on_the_random_shape(tiny):
    from verify_server.kv_cache import KVCache, KVLayout
    from verify_server.model_runner import ModelInput, ModelRunner

    cfg = tiny.model.config
    kv = KVCache(KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim), 16, 4, 32)
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11, 2]
    with torch.inference_mode():
        want = tiny.model(torch.tensor([ids])).logits[0]
    runner = ModelRunner(tiny.model, kv)
    table = [9, 2, 14]  # positions 0-3, 4-7 and 8-11, in blocks far apart
    got = runner.forward(ModelInput.build(ids[:6], [Segment(tuple(table), 0, 6, 6, 4)], list(range(6))))
    assert torch.allclose(got, want[:6], atol=1e-4)
    got = runner.forward(ModelInput.build(ids[6:], [Segment(tuple(table), 0, 4, 10, 4)], list(range(4))))
    assert torch.allclose(got, want[6:], atol=1e-4)


class _SleepingClock:
    """time for the engine and its step floor: monotonic runs on with the host's, and a sleep passes at once but
    moves it on by the time slept, so a floored step measures exactly its floor however loaded the host is."""

    def __init__(self):
        self.slept = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.slept

    def sleep(self, seconds: float) -> None:
        self.slept += max(seconds, 0.0)


def _one_step(target, **floor):
    """A fresh engine (warmed up, as a server is) with one prefilled session; one draft of three tokens verified."""
    from verify_server.config import ServerConfig
    from verify_server.engine import Engine
    from verify_server.sessions import DraftRequest, OpenRequest, SamplingParams

    engine = Engine(ServerConfig(max_sessions=1, max_seq_len=64, target="random:llama-tiny", **floor), target)
    engine.warmup()
    opened, verdicts = [], []
    engine.open(OpenRequest((1, 2, 3, 4), SamplingParams(), 8, frozenset()), opened.append)
    engine._drain(0)
    while engine._prefilling():
        engine.step()
    engine.verify(opened[0].id, DraftRequest(1, (5, 6, 7)), verdicts.append)
    engine._drain(0)
    engine.step()
    return verdicts[0], engine.costs.token_ms


def test_a_step_floor_pads_each_step_to_a_gpus_profile_and_changes_no_verdict(tiny, monkeypatch):
    from verify_server import engine, step_floor

    bare, _ = _one_step(tiny)
    clock = _SleepingClock()
    monkeypatch.setattr(engine, "time", clock)
    monkeypatch.setattr(step_floor, "time", clock)
    # A floor far above what the tiny target takes even on a loaded host, so the steps are the floor's.
    padded, token_ms = _one_step(tiny, min_step_ms=300.0, min_step_ms_per_token=40.0)
    assert (padded.n_accepted, padded.next_token) == (bare.n_accepted, bare.next_token)
    assert padded.step_tokens == bare.step_tokens == 4  # the three drafted tokens and the one before them
    assert padded.step_ms >= 300.0 + 40.0 * padded.step_tokens
    assert clock.slept > 0.0
    # The cost model the devices' controllers read sees the floor's slope (the warm-up's steps of 1-16 tokens).
    assert token_ms == pytest.approx(40.0, abs=0.5)


def test_a_max_seq_len_past_the_targets_context_is_refused(tiny):
    from verify_server.config import ServerConfig
    from verify_server.engine import Engine

    context = tiny.model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"max_seq_len {context + 1} is past the target's context length {context}"):
        Engine(ServerConfig(max_seq_len=context + 1, max_sessions=1), tiny)
