"""The one summary every benchmark gives of devices' generations."""

from bench.report import device_summary
from edge_client.result import GenerationResult


def test_a_device_summary_counts_tokens_rounds_and_acceptance_over_all_its_generations():
    one = GenerationResult([1], [2, 3, 4], rounds=2, draft_tokens=6, accepted_tokens=3, elapsed_s=0.5)
    two = GenerationResult([1], [5], rounds=1, draft_tokens=2, accepted_tokens=0, elapsed_s=0.25)
    s = device_summary([one, two])
    assert (s["tokens"], s["drafted"], s["accepted"], s["rounds"]) == (4, 8, 3, 3)
    assert s["acceptance_rate"] == 3 / 8
    assert s["mean_acceptance_length"] == 1 + 3 / 3  # vLLM's: 1 + accepted / rounds
    assert s["draft_tokens_per_round"] == 8 / 3
    assert s["tokens_per_s"] == 4 / 0.75  # tokens over the generations' summed time
    assert device_summary([])["mean_acceptance_length"] == 0.0
