"""Target families beyond Llama: Qwen3 (q/k norms), Gemma 3 text (sliding-window layers interleaved with global
ones, q/k norms, Gemma's norms, activation and embedding scale) and Mistral's sliding window. Each is a tiny
random-weight model built from a config in the devices' vocabulary, saved as a Hugging Face folder and served
from it as a user would; SLED's greedy tokens must equal transformers' generate() on it, with drafts verified."""

import asyncio

import pytest
import torch

from edge_client.drafters.base import Proposal
from edge_client.generation import generate
from edge_client.request import Request
from edge_client.policy import DraftPolicy
from edge_client.transport import VerifierClient
from kernels.attention import Segment
from tests.conftest import ServerThread, all_freed

pytestmark = pytest.mark.model

WINDOW = 12  # shorter than every prompt below, so the sliding layers' window matters
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, max_position_embeddings=512)
FAMILIES = {
    "qwen3": dict(rope_theta=10000.0),
    "gemma3_text": dict(query_pre_attn_scalar=16, sliding_window=WINDOW, final_logit_softcapping=30.0,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "linear", "rope_theta": 1e6,
                                                            "factor": 8.0}}),
    "mistral": dict(sliding_window=WINDOW, rope_theta=10000.0),
}
PROMPT = [1, 504, 3458, 314, 1345, 30, 1073, 2117, 7050, 28, 2683, 359, 253, 5356, 5646, 11, 288, 260, 1345, 314,
          4172, 30, 378, 1431, 5300, 28, 4153, 3012, 1351, 30]


def build_folder(kind: str, folder) -> None:
    """A random-weight model of `kind` with every norm weight perturbed (a norm read as w rather than 1 + w, or
    skipped, then shows), saved with the devices' tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from verify_server.model_loader import vocabulary_tokenizer

    tokenizer = vocabulary_tokenizer()
    config = AutoConfig.for_model(kind, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
                                  **SHAPE, **FAMILIES[kind])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    from verify_server.model_loader import load_target

    folder = tmp_path_factory.mktemp(request.param)
    build_folder(request.param, folder)
    return request.param, folder, load_target(folder, torch.device("cpu"), torch.float32)


def reference(target, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = target.model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                    eos_token_id=list(target.eos_token_ids), pad_token_id=target.eos_token_ids[0])
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("attention", ["sdpa", "flex", "reference"])
def test_the_runner_gives_transformers_logits_on_a_ragged_batch(family, attention):
    """A prompt longer than the window, then in one batch a decode token of one session and a draft of another:
    every row's logits are transformers' at that position."""
    from verify_server.kv_cache import KVCache, KVLayout
    from verify_server.model_runner import ModelInput, ModelRunner

    kind, _, target = family
    cfg = target.model.config
    ids = torch.tensor(PROMPT)
    with torch.inference_mode():
        want = target.model(ids[None]).logits[0]
    kv = KVCache(KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim), 32, 4, 64)
    runner = ModelRunner(target.model, kv, attention=attention)
    a, b = [], []
    n = len(PROMPT)
    for _ in range(-(-n // 4)):  # the two sessions' blocks interleaved: neither's are consecutive
        kv.grow(a, len(a) * 4 + 1)
        kv.grow(b, len(b) * 4 + 1)
    a, b = tuple(a), tuple(b)
    got = runner.forward(ModelInput.build(PROMPT[:n - 1], [Segment(a, 0, n - 1, n - 1, 4)], list(range(n - 1))))
    assert torch.allclose(got, want[:n - 1], atol=1e-4)
    runner.forward(ModelInput.build(PROMPT[:n - 5], [Segment(b, 0, n - 5, n - 5, 4)], []))
    # session a decodes its last prompt token; session b verifies a draft of its last five
    got = runner.forward(ModelInput.build(PROMPT[n - 1:] + PROMPT[n - 5:],
                                          [Segment(a, 0, 1, n, 4), Segment(b, 1, 5, n, 4)], list(range(6))))
    assert torch.allclose(got[0], want[n - 1], atol=1e-4)
    assert torch.allclose(got[1:], want[n - 5:], atol=1e-4)


class Oracle:
    """Drafts the target's own greedy continuation with every third drafted position wrong: some drafts are
    accepted whole, others cut short, so both paths of verification run."""

    name = "oracle"

    def __init__(self, prompt: list[int], continuation: list[int]):
        self.full = prompt + continuation
        self.drafted = 0

    def begin(self, context, sampling):
        pass

    def propose(self, context, k, stop=None):
        start = len(context)
        tokens = []
        for i in range(start, min(start + k, len(self.full))):
            self.drafted += 1
            tokens.append(self.full[i] if self.drafted % 3 else (self.full[i] + 1) % 49152)
        return Proposal(tokens)

    def accept(self, context, ahead=()):
        pass

    def close(self):
        pass


def test_greedy_through_a_server_and_a_device_equals_transformers_generate(family, tokenizer):
    from verify_server.config import ServerConfig

    kind, folder, target = family
    want = reference(target, PROMPT, 24)
    server = ServerThread(ServerConfig(host="127.0.0.1", port=0, max_sessions=4, max_seq_len=128, seed=0,
                                       target=str(folder)), target).load()
    try:
        drafter = Oracle(PROMPT, want)

        async def go():
            client = VerifierClient(server.address)
            try:
                return await generate(
                    client,
                    drafter,
                    tokenizer,
                    Request(PROMPT, max_tokens=24, policy=DraftPolicy(draft_tokens=4, adaptive=False)),
                )
            finally:
                await client.close()

        result = asyncio.run(go())
        assert result.token_ids == want
        stats = result.stats()
        assert 0 < stats["accepted_tokens"] < stats["draft_tokens"]  # drafts accepted and drafts rejected
        assert all_freed(server.server)
    finally:
        server.stop()


def test_the_fused_cpu_step_computes_every_family_as_transformers(family):
    """Qwen3's q and k norms; Gemma 3's norms around attention and the MLP, its tanh GELU, two RoPE tables and
    sliding layers; Mistral's window: the prompt is longer than the window, and its blocks of 4 put the window's
    first position inside a block."""
    from verify_server.kv_cache import KVCache, KVLayout
    from verify_server.model_runner import ModelInput, ModelRunner

    kind, _, target = family
    cfg = target.model.config
    kv = KVCache(KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim), 16, 4, 64)
    runner = ModelRunner(target.model, kv, fused="on", fused_max_tokens=64)
    assert ModelRunner(target.model, kv, fused="auto").fused is not None
    blocks = tuple(kv.blocks.allocate(16))
    n = len(PROMPT)
    with torch.inference_mode():
        want = target.model(torch.tensor([PROMPT])).logits[0]
    # the prompt in one step, then its last 7 tokens again as a verify step over the 23 cached
    got = runner.forward(ModelInput.build(PROMPT, [Segment(blocks, 0, n, n, 4)], list(range(n))))
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max().item()
    again = runner.forward(ModelInput.build(PROMPT[-7:], [Segment(blocks, 0, 7, n, 4)], list(range(7))))
    assert torch.allclose(again, want[-7:], atol=1e-4), (again - want[-7:]).abs().max().item()


def test_an_unsupported_architecture_is_refused_with_its_name_and_the_supported_ones(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from verify_server.model_loader import load_target
    from verify_server.model_runner import SUPPORTED_ARCHITECTURES

    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="unsupported target architecture 'gpt2'") as err:
        load_target(tmp_path, torch.device("cpu"), torch.float32)
    assert all(name in str(err.value) for name in SUPPORTED_ARCHITECTURES)
