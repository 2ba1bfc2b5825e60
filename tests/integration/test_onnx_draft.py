"""The exported ONNX draft computes what the torch model computes, and the onnx drafter rolls back."""

import numpy as np
import onnxruntime as ort
import pytest
import torch

from edge_client.drafters import DrafterOptions, create_drafter
from edge_client.sampling import SamplingParams
from tests.conftest import user_tool

pytestmark = pytest.mark.model
IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11, 30]


def torch_logits(target, layers, ids):
    """The self-speculative draft's logits by transformers itself: the target's first `layers` layers, then its final
    norm and head."""
    with torch.inference_mode():
        hidden = target.model(torch.tensor([ids]), output_hidden_states=True).hidden_states[layers]
        return target.model.lm_head(target.model.model.norm(hidden))[0].numpy()


def run(session, ids, keys, values):
    return session.run(None, {"input_ids": np.asarray([ids]), "past_keys": keys, "past_values": values})


def test_fp32_export_matches_torch_next_token_logits_with_kv(target, onnx_drafts):
    want = torch_logits(target, 2, IDS)
    s = ort.InferenceSession(str(onnx_drafts["fp32"]))
    empty = np.zeros((2, 1, 3, 0, 64), np.float32)
    logits, k, v = run(s, IDS[:6], empty, empty)
    assert np.allclose(logits[0], want[:6], atol=1e-3)
    more, k2, _ = run(s, IDS[6:], k, v)  # continue from the cache
    assert np.allclose(more[0], want[6:], atol=1e-3)
    again, _, _ = run(s, IDS[4:], k[:, :, :, :4], v[:, :, :, :4])  # roll back to 4 and go on
    assert np.allclose(again[0], want[4:], atol=1e-3)
    assert k2.shape == (2, 1, 3, len(IDS), 64)


def test_int8_export_stays_close_to_torch(target, onnx_drafts):
    want = torch_logits(target, 6, IDS)
    s = ort.InferenceSession(str(onnx_drafts["int8"]))
    empty = np.zeros((6, 1, 3, 0, 64), np.float32)
    got = run(s, IDS, empty, empty)[0][0]
    for row_got, row_want in zip(got, want):
        assert np.corrcoef(row_got, row_want)[0, 1] > 0.99
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.8


def test_onnx_drafter_rolls_back_to_the_committed_context(onnx_drafts):
    opts = DrafterOptions(onnx_model=str(onnx_drafts["fp32"]), context_size=256)
    drafter, fresh = create_drafter("onnx", opts), create_drafter("onnx", opts)
    drafter.begin(IDS, SamplingParams())
    first = drafter.propose(IDS, 4).token_ids
    committed = IDS + first[:1] + [7]
    drafter.accept(committed)
    assert drafter._keys.shape[3] == len(drafter._evaluated) <= len(IDS) + 1
    fresh.begin(committed, SamplingParams())
    assert drafter.propose(committed, 4).token_ids == fresh.propose(committed, 4).token_ids


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="--onnx-model"):
        create_drafter("onnx", DrafterOptions())
    with pytest.raises(FileNotFoundError, match="does not exist"):
        create_drafter("onnx", DrafterOptions(onnx_model=str(tmp_path / "none.onnx")))


@pytest.mark.parametrize("layers", [0, -1, 31])
def test_a_layer_count_outside_the_model_is_refused_before_anything_is_written(tmp_path, layers):
    # 0 once counted as "not given" and exported all 30 layers
    done = user_tool("export_onnx_draft.py", "--output", str(tmp_path / "draft.onnx"), "--layers", str(layers))
    assert done.returncode == 2 and f"--layers must be in 1..30, got {layers}" in done.stderr, done.stderr
    assert list(tmp_path.iterdir()) == []
