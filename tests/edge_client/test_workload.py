"""sled-edge workload: bad settings are refused before any model loads."""

import asyncio

import pytest

from edge_client.config import EdgeConfig
from edge_client.workload import run_workload


@pytest.mark.parametrize("requests, max_tokens, offset, temperature, message", [
    (0, 64, 0, 0.0, "requests >= 1"),
    (4, 0, 0, 0.0, "max_tokens >= 1"),
    (4, 64, -1, 0.0, "offset >= 0"),
    (4, 64, 0, float("nan"), "temperature must be >= 0"),
])
def test_bad_workload_settings_are_refused_before_the_drafter_loads(requests, max_tokens, offset, temperature,
                                                                     message):
    # a drafter model that does not exist: reaching the load would raise FileNotFoundError instead
    config = EdgeConfig(draft_model="/nowhere/draft.gguf")
    with pytest.raises(ValueError, match=message):
        asyncio.run(run_workload(config, requests, max_tokens, "device", offset, temperature))
