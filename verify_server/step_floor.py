"""A floor under every forward, for capacity experiments: a small target with it has a GPU's step profile on a CPU
(nearly flat in the step's tokens), so the devices' side of a GPU run can be studied without one."""

from __future__ import annotations

import time


class StepFloor:
    """The runner, each forward lasting at least min_ms + per_token_ms × its tokens, the rest slept. Slept inside the
    forward, so the step cost model's per-token slope, which the devices' controllers read, is the floor's."""

    def __init__(self, runner, min_ms: float, per_token_ms: float):
        self.runner, self.min_ms, self.per_token_ms = runner, min_ms, per_token_ms

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def forward(self, inp):
        t0 = time.monotonic()
        logits = self.runner.forward(inp)
        left = (self.min_ms + self.per_token_ms * int(inp.token_ids.numel())) / 1000.0 - (time.monotonic() - t0)
        if left > 0:
            time.sleep(left)
        return logits
