import numpy as np
import pytest

from edge_client.drafters import DrafterOptions, create_drafter
from edge_client.drafters.ngram import lookup
from edge_client.sampling import SamplingParams, sample, sparse_distribution


def test_prompt_lookup_continues_latest_match():
    assert lookup([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 3, 3, 1) == [7, 8, 1]


def test_prompt_lookup_falls_back_to_shorter_ngrams():
    assert lookup([5, 6, 4, 4, 7, 6], 2, 3, 1) == [4, 4]


def test_prompt_lookup_finds_nothing():
    assert lookup([1, 2, 3], 4, 3, 1) == []
    assert lookup([1], 4, 3, 1) == []


def test_unknown_drafter_names_the_choices():
    with pytest.raises(ValueError) as err:
        create_drafter("gpt5")
    assert "llama-cpp" in str(err.value) and "ngram" in str(err.value)


def test_sparse_distribution_top_k_and_top_p():
    logits = np.log(np.array([0.1, 0.5, 0.25, 0.15], dtype=np.float32))
    ids, probs = sparse_distribution(logits, 1.0, 2)
    assert ids.tolist() == [1, 2] and np.allclose(probs, [2 / 3, 1 / 3])
    ids, probs = sparse_distribution(logits, 1.0, 4, top_p=0.7)
    assert ids.tolist() == [1, 2] and probs.dtype == np.float32 and abs(probs.sum() - 1) < 1e-6


def test_sample_draws_from_exactly_the_sent_distribution():
    ids, probs = np.array([3, 8, 5]), np.array([0.6, 0.3, 0.1], dtype=np.float32)
    rng = np.random.default_rng(0)
    draws = np.array([sample(ids, probs, rng) for _ in range(20000)])
    freq = [(draws == i).mean() for i in ids]
    assert np.allclose(freq, probs, atol=0.015)


@pytest.mark.model
@pytest.mark.parametrize("flash_attn", [False, True], ids=["attention", "flash-attention"])
def test_llama_cpp_drafter_rolls_back_to_the_committed_context(tokenizer, flash_attn):
    opts = DrafterOptions(context_size=256, threads=1, flash_attn=flash_attn)
    drafter, fresh = create_drafter("llama-cpp", opts), create_drafter("llama-cpp", opts)
    context = tokenizer.encode("The capital of France is Paris. The capital of Spain is")
    drafter.begin(context, SamplingParams())
    first = drafter.propose(context, 5).token_ids
    assert len(first) >= 1
    # The server accepted 2 tokens and corrected the third with a token the drafter did not propose.
    other = 0 if first[2 % len(first)] != 0 else 1
    committed = context + first[:2] + [other]
    drafter.accept(committed)
    assert drafter._evaluated == committed[: len(drafter._evaluated)]
    assert len(drafter._evaluated) <= len(context) + 2
    fresh.begin(committed, SamplingParams())
    assert drafter.propose(committed, 4).token_ids == fresh.propose(committed, 4).token_ids
    drafter.close()
    fresh.close()


@pytest.mark.model
def test_llama_cpp_drafter_sends_the_distribution_it_sampled_from(tokenizer):
    drafter = create_drafter("llama-cpp", DrafterOptions(context_size=256, threads=1, top_k_cap=8))
    context = tokenizer.encode("Once upon a time")
    drafter.begin(context, SamplingParams(temperature=0.9, seed=4))
    prop = drafter.propose(context, 3)
    assert len(prop.q_ids) == len(prop.token_ids) == 3
    for tok, ids, probs in zip(prop.token_ids, prop.q_ids, prop.q_probs):
        assert len(ids) <= 8 and abs(float(probs.sum()) - 1) < 1e-5 and tok in ids.tolist()
    drafter.close()


@pytest.mark.model
def test_both_sides_compute_the_same_fingerprint(tokenizer, target):
    assert tokenizer.fingerprint == target.fingerprint
    assert tokenizer.vocab_tokens == target.vocab_tokens
