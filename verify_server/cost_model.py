"""What a step costs: time = fixed + per_token * tokens, fitted by least squares over the recent steps."""

from __future__ import annotations

import collections


class StepCostModel:
    """The devices read `token_ms` (the marginal cost of one more token) to size their drafts; the scheduler reads
    `ms` and `tokens_costing` to size prompt chunks."""

    def __init__(self, window: int = 256):
        self.window = window
        self._steps: collections.deque[tuple[int, float]] = collections.deque()  # (tokens, seconds)
        self._sums = [0.0] * 5  # n, sum t, sum y, sum t*t, sum t*y over _steps
        self.token_ms = 0.0
        self.fixed_ms = 0.0

    def record(self, tokens: int, seconds: float) -> None:
        self._add(tokens, seconds, 1.0)
        self._steps.append((tokens, seconds))
        if len(self._steps) > self.window:
            self._add(*self._steps.popleft(), -1.0)
        n, st, sy, stt, sty = self._sums
        var = n * stt - st * st
        if var > 1e-9:
            slope = max((n * sty - st * sy) / var, 0.0)
            self.token_ms = slope * 1000.0
            self.fixed_ms = max((sy - slope * st) / n, 0.0) * 1000.0

    def _add(self, tokens: int, seconds: float, sign: float) -> None:
        for i, v in enumerate((1.0, tokens, seconds, tokens * tokens, tokens * seconds)):
            self._sums[i] += sign * v

    def ms(self, tokens: int) -> float:
        """A step of `tokens` tokens, as fitted (0 before any step is measured)."""
        return self.fixed_ms + self.token_ms * tokens

    def tokens_costing(self, ms: float, at_most: int) -> int:
        """How many tokens add about `ms` to a step (1 to `at_most`; `at_most` where tokens cost nothing)."""
        if self.token_ms <= 0:
            return at_most
        return max(1, min(at_most, int(ms / self.token_ms + 1e-6)))  # a fit's rounding is not a token less
