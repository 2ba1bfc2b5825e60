import math

import pytest
import torch
from scipy.stats import chisquare

from kernels.cpu_step import row_argmax
from kernels.rejection_sampler import DraftBatch, NonFiniteLogitsError, SamplingBatch, rejection_sample, target_probs

V = 8


@pytest.fixture(params=["torch", "c"])
def way(request):
    """Each row's argmax and finiteness through PyTorch, or through the fused CPU step's one C pass."""
    return None if request.param == "torch" else row_argmax


def greedy_logits(argmaxes: list[int]) -> torch.Tensor:  # [len, V]
    logits = torch.zeros(len(argmaxes), V)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


def batch(temps, top_k=None, top_p=None, generators=None, seed=0) -> SamplingBatch:
    n = len(temps)
    return SamplingBatch(
        temperature=torch.tensor(temps, dtype=torch.float32),
        top_k=torch.tensor(top_k or [0] * n, dtype=torch.long),
        top_p=torch.tensor(top_p or [1.0] * n, dtype=torch.float32),
        generators=tuple(generators or [None] * n),
        default=torch.Generator().manual_seed(seed),
    )


def one_hot_q(drafts: list[int]):
    ids = torch.tensor(drafts, dtype=torch.long).view(-1, 1)
    return ids, torch.ones(len(drafts), 1)


def run_greedy(requests: list[tuple[list[int], list[int]]], way=None):
    """requests: (draft tokens, target argmax for each of the k+1 rows)."""
    drafts = [t for d, _ in requests for t in d]
    logits = torch.cat([greedy_logits(a) for _, a in requests])
    cu = torch.tensor([0] + [len(d) for d, _ in requests]).cumsum(0)
    q_ids, q_probs = one_hot_q(drafts)
    out = rejection_sample(logits, DraftBatch(torch.tensor(drafts, dtype=torch.long), cu, q_ids, q_probs), batch([0.0] * len(requests)), row_argmax=way)
    return out.num_accepted.tolist(), out.next_token.tolist()


# ---- greedy, as token lists ----

def test_greedy_full_accept_emits_bonus(way):
    assert run_greedy([([3, 1, 4], [3, 1, 4, 7])], way) == ([3], [7])


def test_greedy_first_mismatch_emits_target_argmax(way):
    assert run_greedy([([3, 1, 4], [3, 2, 4, 7])], way) == ([1], [2])


def test_greedy_mismatch_at_first_token(way):
    assert run_greedy([([5, 1], [6, 1, 1])], way) == ([0], [6])


def test_greedy_empty_draft_is_plain_decoding(way):
    assert run_greedy([([], [4])], way) == ([0], [4])


def test_greedy_ragged_batch_keeps_requests_apart(way):
    got = run_greedy([([3, 1, 4], [3, 1, 5, 0]), ([], [2]), ([6, 6], [6, 6, 1]), ([7], [0, 3])], way)
    assert got == ([2, 0, 2, 0], [5, 2, 1, 0])


# ---- the traps ----

def test_nan_or_inf_logits_raise_naming_the_request(way):
    logits = torch.cat([greedy_logits([1, 2]), greedy_logits([3])])
    logits[2, 0] = float("nan")
    with pytest.raises(NonFiniteLogitsError) as err:
        rejection_sample(logits, DraftBatch(torch.tensor([1]), torch.tensor([0, 1, 1]), *one_hot_q([1])), batch([0.0, 0.0]), row_argmax=way)
    assert err.value.request_indices == [1]
    logits[2, 0] = 0.0
    logits[0, 3] = float("inf")
    with pytest.raises(NonFiniteLogitsError) as err:
        rejection_sample(logits, DraftBatch(torch.tensor([1]), torch.tensor([0, 1, 1]), *one_hot_q([1])), batch([1.0, 1.0]), row_argmax=way)
    assert err.value.request_indices == [0]
    logits[0, 3] = 0.0
    logits[2, V - 1] = float("-inf")  # the last column, where a reduction's tail is handled apart
    with pytest.raises(NonFiniteLogitsError) as err:
        rejection_sample(logits, DraftBatch(torch.tensor([1]), torch.tensor([0, 1, 1]), *one_hot_q([1])), batch([0.0, 0.0]), row_argmax=way)
    assert err.value.request_indices == [1]


def test_draft_token_outside_q_support_is_rejected():
    # The target puts almost all mass on token 2; the draft says 2 but its q gives 2 no mass.
    logits = torch.full((2, V), -10.0)
    logits[:, 2] = 10.0
    q_ids = torch.tensor([[0, 1]])
    q_probs = torch.tensor([[0.5, 0.5]])
    for seed in range(50):
        out = rejection_sample(logits, DraftBatch(torch.tensor([2]), torch.tensor([0, 1]), q_ids, q_probs), batch([1.0], seed=seed))
        assert out.num_accepted.tolist() == [0]


def test_zero_residual_falls_back_to_target():
    # q >= p everywhere (q over-counts), so after a rejection max(0, p - q) is all zero.
    logits = torch.zeros(2, V)
    q_ids = torch.arange(V).view(1, V)
    q_probs = torch.full((1, V), 2.0 / V)
    nexts = []
    for seed in range(400):
        out = rejection_sample(logits, DraftBatch(torch.tensor([0]), torch.tensor([0, 1]), q_ids, q_probs), batch([1.0], seed=seed))
        if out.num_accepted.item() == 0:
            nexts.append(out.next_token.item())
    assert 100 < len(nexts) < 300  # accepted with probability p/q = 1/2
    assert set(nexts) == set(range(V))  # drawn from p (uniform), not a degenerate 0/0


def test_acceptance_follows_ratio_not_a_constant_draw():
    # p(x) / q(x) = 1/2 at both positions: each is accepted half of the time, independently.
    n = 4000
    logits = torch.zeros(3 * n, V)
    logits[:, 0] = math.log(3.0)  # p(0) = 3 / 10 ... set so that p(0) = 0.3
    logits[:, 1:] = math.log(1.0)
    p0 = 3.0 / (3.0 + V - 1)
    drafts = torch.zeros(2 * n, dtype=torch.long)
    q_ids = torch.tensor([[0, 1]]).repeat(2 * n, 1)
    q_probs = torch.tensor([[2 * p0, 1 - 2 * p0]]).repeat(2 * n, 1)
    cu = torch.arange(0, 2 * n + 1, 2)
    out = rejection_sample(logits, DraftBatch(drafts, cu, q_ids, q_probs), batch([1.0] * n, seed=7))
    acc = out.num_accepted
    first = (acc >= 1).float().mean().item()
    both = (acc == 2).float().mean().item()
    assert abs(first - 0.5) < 0.04
    assert abs(both - 0.25) < 0.04  # independent draws per position, not one shared draw


def test_seeded_generators_reproduce_and_differ():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(1))
    q_ids = torch.arange(V).repeat(4, 1)
    q_probs = torch.softmax(torch.randn(4, V, generator=torch.Generator().manual_seed(2)), -1)
    drafts = torch.tensor([1, 2, 3, 4])

    def once(seed):
        gen = torch.Generator().manual_seed(seed)
        out = rejection_sample(logits, DraftBatch(drafts, torch.tensor([0, 4]), q_ids, q_probs), batch([1.0], generators=[gen], seed=999))
        return out.num_accepted.item(), out.next_token.item()

    runs = {seed: once(seed) for seed in range(30)}
    assert all(once(seed) == runs[seed] for seed in range(30))
    assert len(set(runs.values())) > 3


def test_target_probs_applies_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    one = torch.ones(1)
    p = target_probs(logits, one, torch.tensor([2]), one)
    assert torch.allclose(p, torch.tensor([[2 / 3, 1 / 3, 0, 0]]), atol=1e-6)
    p = target_probs(logits, one, torch.tensor([0]), torch.tensor([0.7]))
    assert torch.allclose(p, torch.tensor([[2 / 3, 1 / 3, 0, 0]]), atol=1e-6)
    p = target_probs(logits, torch.tensor([0.5]), torch.tensor([0]), one)
    expect = torch.tensor([0.25, 0.0625, 0.0225, 0.01])
    assert torch.allclose(p[0], expect / expect.sum(), atol=1e-6)


# ---- lossless: speculative sampling reproduces the target distribution ----

def _chi2_ok(samples: torch.Tensor, probs: torch.Tensor) -> None:
    counts = torch.bincount(samples, minlength=V).double()
    expected = probs.double() * counts.sum()
    assert counts[expected == 0].sum() == 0, "sampled a token the target gives no mass"
    keep = expected > 0
    exp = expected[keep] / expected[keep].sum() * counts.sum()
    stat = chisquare(counts[keep].numpy(), exp.numpy())
    assert stat.pvalue > 1e-3, f"counts {counts.tolist()} vs expected {expected.tolist()} (p={stat.pvalue:.2g})"

def test_a_row_without_top_p_keeps_its_whole_tail_beside_a_cut_row():
    # These logits' float32 running sum reaches 1 before their last tokens: comparing it with top_p = 1 cut real
    # tokens of a row that asked for no cut whenever another row of the batch did.
    logits = torch.randn(1, 49152, generator=torch.Generator().manual_seed(3)) * 2
    batch = torch.cat([logits, logits])
    probs = target_probs(batch, torch.ones(2), torch.zeros(2, dtype=torch.long), torch.tensor([0.5, 1.0]))
    full = torch.softmax(logits[0], -1)
    assert torch.equal(probs[1] > 0, full > 0)
    assert torch.allclose(probs[1], full)
    assert (probs[0] > 0).sum() < (full > 0).sum()


@pytest.mark.parametrize(
    "temperature,top_k,top_p,q_support",
    [(1.0, 0, 1.0, V), (1.0, 0, 1.0, 3), (0.7, 5, 1.0, 3), (1.3, 0, 0.8, 4), (1.0, 0, 1.0, 1)],
)
def test_speculative_sampling_matches_target_distribution(temperature, top_k, top_p, q_support):
    n, k = 30000, 2
    g = torch.Generator().manual_seed(1234 + q_support)
    rows = torch.randn(k + 1, V, generator=g) * 1.5  # target logits for positions 1, 2 and the bonus
    draft_logits = rows + torch.randn(k + 1, V, generator=g)  # a related but different draft model
    # Sparse q: the drafter's top-q_support tokens, renormalized; drafts are sampled from exactly that.
    q_ids = draft_logits[:k].topk(q_support, dim=-1).indices  # [k, support]
    q_probs = torch.softmax(draft_logits[:k].gather(-1, q_ids), dim=-1)  # [k, support]
    picks = torch.multinomial(q_probs, n, replacement=True, generator=g).T  # [n, k]
    drafts = q_ids[torch.arange(k), picks]  # [n, k]

    logits = rows.repeat(n, 1)  # [n * (k + 1), V]
    cu = torch.arange(0, n * k + 1, k)
    out = rejection_sample(logits, DraftBatch(drafts.reshape(-1), cu, q_ids.repeat(n, 1), q_probs.repeat(n, 1)), batch([temperature] * n, [top_k] * n, [top_p] * n, seed=5))
    acc, nxt = out.num_accepted, out.next_token
    p = target_probs(rows, torch.full((k + 1,), temperature), torch.full((k + 1,), top_k), torch.full((k + 1,), top_p))

    first = torch.where(acc >= 1, drafts[:, 0], nxt)
    _chi2_ok(first, p[0])
    past_first = acc >= 1
    second = torch.where(acc[past_first] >= 2, drafts[past_first, 1], nxt[past_first])
    _chi2_ok(second, p[1])
    _chi2_ok(nxt[acc == 2], p[2])
    assert 0 < acc.float().mean() < k  # drafts were really exercised


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.8)])
def test_under_a_constraints_mask_drafts_keep_to_the_masked_target_distribution(temperature, top_p):
    """A constraint masks the target's rows with the lowest finite logit (verify_server.constraint): drafts drawn
    from a q that puts weight on forbidden tokens must never commit one, and what is committed follows the masked
    target's distribution."""
    n, k = 30000, 2
    g = torch.Generator().manual_seed(99)
    rows = torch.randn(k + 1, V, generator=g) * 1.5
    allowed = torch.tensor([[1, 1, 0, 1, 0, 1, 1, 0], [0, 1, 1, 1, 1, 0, 0, 1], [1, 0, 1, 0, 1, 1, 0, 1]]).bool()
    masked = rows.masked_fill(~allowed, torch.finfo(rows.dtype).min)
    q_probs = torch.softmax(rows[:k] + torch.randn(k, V, generator=g), dim=-1)  # an unmasked drafter: all of V
    q_ids = torch.arange(V).repeat(k, 1)
    drafts = torch.multinomial(q_probs, n, replacement=True, generator=g).T  # [n, k]
    out = rejection_sample(masked.repeat(n, 1), DraftBatch(drafts.reshape(-1), torch.arange(0, n * k + 1, k),
                                                           q_ids.repeat(n, 1), q_probs.repeat(n, 1)),
                           batch([temperature] * n, top_p=[top_p] * n, seed=7))
    acc, nxt = out.num_accepted, out.next_token
    p = target_probs(masked, torch.full((k + 1,), temperature), torch.zeros(k + 1, dtype=torch.long),
                     torch.full((k + 1,), top_p))
    assert (p[~allowed] == 0).all()
    first = torch.where(acc >= 1, drafts[:, 0], nxt)
    assert allowed[0, first].all()
    _chi2_ok(first, p[0])
    past = acc >= 1
    second = torch.where(acc[past] >= 2, drafts[past, 1], nxt[past])
    assert allowed[1, second].all()
    _chi2_ok(second, p[1])
    assert allowed[2, nxt[acc == 2]].all()
    assert (drafts[:, 0][~allowed[0, drafts[:, 0]]] >= 0).any()  # forbidden tokens were drafted, and refused
