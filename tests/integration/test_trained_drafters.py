"""Drafters trained by sled-train stay lossless, however little trained: greedy text is the target's own, and a
parallel drafter's slot distributions, sent as q, keep sampled output on the target's distribution."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from edge_client.drafters import DrafterOptions, create_drafter
from edge_client.round import step_ahead
from edge_client.sampling import SamplingParams
from kernels.rejection_sampler import DraftBatch, SamplingBatch, rejection_sample, target_probs
from sled_train.cli import parse
from sled_train.train import train
from tests.conftest import PROMPTS, run
from tests.integration.test_fidelity import _generate_all

pytestmark = pytest.mark.model

KINDS = {"imitation": ("onnx", ["imitation"]), "parallel-ce": ("parallel", ["parallel", "--heads", "3"]),
         "parallel-ctc": ("parallel", ["parallel", "--heads", "3", "--loss", "ctc"])}


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory):
    """A few steps of each kind on the real target's first 2 layers: weak drafters, as a bad training makes."""
    out = tmp_path_factory.mktemp("trained")
    made = {}
    for name, (drafter, args) in KINDS.items():
        path = out / f"{name}.onnx"
        train(parse([*args, "--layers", "2", "--prompts", "4", "--eval-prompts", "2", "--max-new-tokens", "16",
                     "--steps", "3", "--batch", "2", "--output", str(path), "--work", str(out / "work")]), target)
        made[name] = (drafter, path)
    return made


def test_greedy_text_is_the_targets_with_every_trained_drafter(trained, make_server, tokenizer, reference_greedy):
    server = make_server()
    prompts = [tokenizer.encode(p) for p in PROMPTS[:3]]
    for name, (drafter, path) in trained.items():
        opts = DrafterOptions(onnx_model=str(path), context_size=512, threads=1)
        results = run(_generate_all(server.address, tokenizer, [(ids, drafter) for ids in prompts], 32,
                                    options=opts))
        for ids, result in zip(prompts, results):
            assert result.token_ids == reference_greedy(tuple(ids), 32), (name, tokenizer.decode(ids))
        assert sum(r.draft_tokens for r in results) > 0, name


def chi2_ok(samples: np.ndarray, probs: np.ndarray) -> None:
    counts = np.bincount(samples, minlength=len(probs)).astype(float)
    expected = probs.astype(float) * counts.sum()
    assert counts[expected == 0].sum() == 0, "sampled a token the target gives no mass"
    keep = expected > 0
    stat = chisquare(counts[keep], expected[keep] / expected[keep].sum() * counts.sum())
    assert stat.pvalue > 1e-3, f"p = {stat.pvalue:.2g}"


def sharp_slots(count: int, width: int, blank: bool) -> np.ndarray:
    """Slot logits where the choices matter: each slot its own few likely tokens, a CTC slot's blank and the slot
    before's likely token with much of the mass (so a q that kept them would be far off)."""
    rows = np.full((count, width), -30.0, dtype=np.float32)
    for j in range(count):
        likely = ([500, 501], [500, 502, 503], [502, 504])[j % 3]
        rows[j, likely] = np.linspace(2.0, 1.0, len(likely))
        if blank:
            rows[j, width - 1] = 1.5
    return rows


@pytest.mark.parametrize("name", ["parallel-ce", "parallel-ctc"])
def test_sampling_with_a_parallel_drafters_q_keeps_the_target_distribution(trained, name):
    """Drafts drawn by the drafter itself (its q as sent, a CTC draft's q without the blank and the slot before's
    token), verified by the server's rule against a synthetic target over the tokens they use and a few more. The
    slots' logits are set sharp after the model's forward, so that a wrong q shows."""
    _, path = trained[name]
    drafter = create_drafter("parallel", DrafterOptions(onnx_model=str(path), context_size=512, threads=1))
    context, n, k = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11, 30], 6000, 2
    drafter.begin(context, SamplingParams(temperature=1.0))
    drafter.propose(context, k)
    slots = sharp_slots(drafter.slots, drafter._logits.shape[1], drafter.blank is not None)
    proposals = []
    for seed in range(n):  # the context is cached: each seed draws again from the same slots
        drafter.begin(context, SamplingParams(temperature=1.0, seed=seed))
        drafter._logits = slots
        proposals.append(drafter.propose(context, k))
    drafter.close()
    vocab = sorted({int(i) for p in proposals for q in p.q_ids for i in q} | set(range(100, 108)))
    index = {t: i for i, t in enumerate(vocab)}
    width = max(len(q) for p in proposals for q in p.q_ids)
    drafts, q_ids, q_probs, cu = [], [], [], [0]
    for p in proposals:
        for t, ids, probs in zip(p.token_ids, p.q_ids, p.q_probs):
            drafts.append(index[t])
            q_ids.append([index[int(i)] for i in ids] + [index[int(ids[0])]] * (width - len(ids)))
            q_probs.append(list(probs) + [0.0] * (width - len(ids)))
        cu.append(len(drafts))
    lengths = np.diff(cu)
    assert lengths.max() == k and (name == "parallel-ce") == (lengths.min() == k)
    g = torch.Generator().manual_seed(7)
    rows = torch.randn(k + 1, len(vocab), generator=g) * 1.5  # the target at positions 1, 2 and the bonus
    logits = torch.cat([rows[:m + 1] for m in lengths.tolist()])
    sampling = SamplingBatch(temperature=torch.ones(n), top_k=torch.zeros(n, dtype=torch.long),
                             top_p=torch.ones(n), generators=(None,) * n, default=torch.Generator().manual_seed(5))
    out = rejection_sample(logits, DraftBatch(torch.tensor(drafts), torch.tensor(cu), torch.tensor(q_ids),
                                              torch.tensor(q_probs, dtype=torch.float32)), sampling)
    acc, nxt = out.num_accepted.numpy(), out.next_token.numpy()
    p = target_probs(rows, torch.ones(k + 1), torch.zeros(k + 1, dtype=torch.long), torch.ones(k + 1)).numpy()
    first = np.array([drafts[cu[i]] if acc[i] >= 1 else nxt[i] for i in range(n)])
    chi2_ok(first, p[0])
    past = [i for i in range(n) if acc[i] >= 1]
    chi2_ok(np.array([drafts[cu[i] + 1] if acc[i] >= 2 else nxt[i] for i in past]), p[1])
    assert 0 < acc.mean() < k  # drafts were really exercised


@pytest.mark.parametrize("name", ["parallel-ce", "parallel-ctc"])
def test_a_parallel_drafter_drafts_ahead_its_slots_from_one_forward(trained, name):
    """Drafting ahead (while a draft is verified) takes every slot's token from one forward, the tokens propose
    gives, where a plain drafter takes one token a forward."""
    _, path = trained[name]
    drafter = create_drafter("parallel", DrafterOptions(onnx_model=str(path), context_size=512, threads=1))
    context = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11, 30]
    drafter.begin(context, SamplingParams())
    forwards, run_model = [], drafter.session.run
    drafter.session.run = lambda *a, **k: forwards.append(1) or run_model(*a, **k)
    ahead = step_ahead(drafter, context, 3)
    assert len(forwards) == 1 and ahead.token_ids
    if name == "parallel-ce":  # a CE slot always drafts; a CTC one may say blank or repeat
        assert len(ahead.token_ids) == 3 or ahead.token_ids[-1] in drafter.eos_ids
    assert drafter.propose(context, 3).token_ids == ahead.token_ids
    assert len(forwards) == 1  # the cache already held the context
    drafter.close()
