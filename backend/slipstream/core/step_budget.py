"""Stall-free batching: how many prompt tokens a step may take, from what the step will cost.

With a fixed ``max_num_batched_tokens``, a step that carries a long prompt chunk beside the
running decodes takes as long as the chunk makes it, and every decoding request waits that
long for its next token: under arrivals over time, decodes miss their TPOT while prompts
come in. Sarathi-Serve sizes each step's token budget so that the step stays within the
decodes' time target and fills what remains with prompt chunks.

``StepCostModel`` learns a step's time online from the engine's measured steps as
``fixed + per_token x tokens + per_row x rows`` (exponentially weighted least squares: the
machine's speed drifts, a server shares its cores); ``StepBudget`` turns a target step time
into a token budget for the coming step. A user's ``max_num_batched_tokens`` stays the hard
limit; prompts always get at least ``MIN_PREFILL_TOKENS`` a step, so they still get in when
the decodes alone take the whole target; until the model has seen steps of different sizes
the budget is the hard limit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

MIN_PREFILL_TOKENS = 32  # prompt tokens every step may take, whatever the prediction
DECAY = 0.97  # weight of past steps per new one (~30 steps of memory)
MIN_STEPS = 8  # observations before the model limits anything
RIDGE = 1e-6  # keeps the normal equations solvable while the steps look alike


@dataclass
class StepCostModel:
    """Least squares of step seconds on (1, tokens, rows), past steps decaying."""

    # the weighted sums of x x^T (3 x 3) and x y (3), x = (1, tokens, rows)
    xx: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])
    xy: list[float] = field(default_factory=lambda: [0.0] * 3)
    num_steps: int = 0
    token_counts: set[int] = field(default_factory=set)  # distinct sizes seen (recent enough)

    def observe(self, tokens: int, rows: int, seconds: float) -> None:
        x = (1.0, float(tokens), float(rows))
        for i in range(3):
            self.xy[i] = self.xy[i] * DECAY + x[i] * seconds
            for j in range(3):
                self.xx[i][j] = self.xx[i][j] * DECAY + x[i] * x[j]
        self.num_steps += 1
        if len(self.token_counts) < 4:
            self.token_counts.add(tokens)

    @property
    def ready(self) -> bool:
        return self.num_steps >= MIN_STEPS and len(self.token_counts) >= 2

    def coefficients(self) -> Optional[tuple[float, float, float]]:
        """(fixed, per_token, per_row) seconds, or None before the model is ready."""
        if not self.ready:
            return None
        a = [
            [self.xx[i][j] + (RIDGE * self.xx[0][0] if i == j else 0.0) for j in range(3)]
            for i in range(3)
        ]
        return _solve3(a, self.xy)

    def predict(self, tokens: int, rows: int) -> Optional[float]:
        c = self.coefficients()
        return None if c is None else c[0] + c[1] * tokens + c[2] * rows


def _solve3(a: list[list[float]], b: list[float]) -> Optional[tuple[float, float, float]]:
    """Cramer's rule for a 3 x 3 system (None when singular)."""

    def det(m: list[list[float]]) -> float:
        return (
            m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
            - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0])
        )

    d = det(a)
    if abs(d) < 1e-300:
        return None
    out = []
    for col in range(3):
        m = [[b[i] if j == col else a[i][j] for j in range(3)] for i in range(3)]
        out.append(det(m) / d)
    return out[0], out[1], out[2]


@dataclass
class StepBudget:
    """The token budget of the next step for a target step time (seconds)."""

    target_s: float
    hard_limit: int  # max_num_batched_tokens
    model: StepCostModel = field(default_factory=StepCostModel)

    def tokens(self, decode_tokens: int, decode_rows: int) -> int:
        """Budget for a step whose running decodes want ``decode_tokens`` over
        ``decode_rows`` sequences: theirs plus the prompt tokens that keep the predicted time
        within the target (one more row for the prompt), at least ``MIN_PREFILL_TOKENS``."""
        coeffs = self.model.coefficients() if decode_rows else None
        if coeffs is None:
            return self.hard_limit
        fixed, per_token, per_row = coeffs
        if per_token <= 0.0:  # no measurable cost per token (yet): nothing to protect
            return self.hard_limit
        spare = self.target_s - fixed - per_row * (decode_rows + 1) - per_token * decode_tokens
        prefill = max(int(spare / per_token), MIN_PREFILL_TOKENS)
        return min(self.hard_limit, decode_tokens + prefill)

    def observe(self, tokens: int, rows: int, seconds: float) -> None:
        self.model.observe(tokens, rows, seconds)
