"""Load only when it pays: a running estimate of what a load costs against what recomputing
the same tokens costs, both fitted from the engine's own measurements.

Pure Python (no vLLM, no torch), so the decision is unit-tested on numbers alone. The worker
times every load (``swap_in`` of ``n`` blocks) and every forward step (``t`` tokens computed);
the scheduler feeds those samples here and asks :meth:`LoadPolicy.decide` before it claims an
external hit.

Both estimates are refitted after every sample with exponential forgetting (older samples
weigh ``decay`` less per new one), so they follow the machine as it changes (another tenant on
the cores, the daemon's RAM tier filling and reads going to disk):

- load seconds ~= load_fixed + load_per_block * blocks: a least-squares line (a round trip,
  then bytes);
- recompute seconds per token = forward seconds / tokens, summed over the steps that computed
  at least one block of tokens. Decode steps (one token each) are left out: they are mostly
  the step's fixed cost, which a few hundred of them would otherwise spread over too few
  tokens (seen on a shared 2-core machine: decode steps from 1.5 to 250 ms left a
  least-squares slope of zero).

A load of ``b`` blocks replaces ``b * block_size`` recomputed tokens, so it pays when
``load_fixed + load_per_block * b < per_token * b * block_size``. The per-token cost includes
each prefill step's fixed part (small against a prefill) and averages over the prompts seen;
attention makes long contexts cost more per token than the average, so for long prompts the
estimate errs toward recomputing.

Until both lines have ``MIN_SAMPLES`` the policy says yes (it cannot learn what a load costs
without loading). After that, one refused candidate in ``explore_every`` is loaded anyway, so
a load estimate that went stale (the daemon got faster) is corrected by measurement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

#: Samples each line needs before its estimate is trusted.
MIN_SAMPLES: Final = 3
MODES: Final = ("when_faster", "always")


class DecayingLine:
    """``y ~= intercept + slope * x`` by weighted least squares, each older sample weighing
    ``decay`` times less per newer one. Intercept and slope are kept non-negative: a cost.

    Worked example: samples (1, 3), (2, 5), (3, 7) with ``decay=1`` give slope 2, intercept 1.

    >>> line = DecayingLine(decay=1.0)
    >>> for x, y in [(1, 3), (2, 5), (3, 7)]:
    ...     line.add(x, y)
    >>> [round(v, 9) for v in line.fit()], round(line.predict(10), 9)
    ([1.0, 2.0], 21.0)
    """

    def __init__(self, decay: float = 0.97) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError("decay must be in (0, 1]")
        self.decay = decay
        self.count = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self._w = self._w * d + 1.0
        self._x = self._x * d + x
        self._y = self._y * d + y
        self._xx = self._xx * d + x * x
        self._xy = self._xy * d + x * y
        self.count += 1

    def fit(self) -> tuple[float, float]:
        """(intercept, slope). With all samples at one x the line goes through the origin."""
        if self._w == 0.0:
            return 0.0, 0.0
        spread = self._w * self._xx - self._x * self._x
        if spread <= 1e-12 * max(1.0, self._w * self._xx):
            return 0.0, (self._y / self._x if self._x > 0 else 0.0)
        slope = (self._w * self._xy - self._x * self._y) / spread
        if slope < 0.0:  # noise on a flat cost: treat it as all fixed
            return max(0.0, self._y / self._w), 0.0
        intercept = (self._y - slope * self._x) / self._w
        if intercept < 0.0:  # the best line through the origin instead
            return 0.0, self._xy / self._xx
        return intercept, slope

    def predict(self, x: float) -> float:
        intercept, slope = self.fit()
        return intercept + slope * x


class DecayingRatio:
    """``sum(y) / sum(x)`` with older samples weighing ``decay`` less per newer one.

    Worked example: samples (100, 0.2), (300, 0.4) with ``decay=1`` give 0.6 / 400 = 0.0015.

    >>> ratio = DecayingRatio(decay=1.0)
    >>> ratio.add(100, 0.2); ratio.add(300, 0.4)
    >>> round(ratio.value(), 12)
    0.0015
    """

    def __init__(self, decay: float = 0.97) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError("decay must be in (0, 1]")
        self.decay = decay
        self.count = 0
        self._x = self._y = 0.0

    def add(self, x: float, y: float) -> None:
        self._x = self._x * self.decay + x
        self._y = self._y * self.decay + y
        self.count += 1

    def value(self) -> float:
        return self._y / self._x if self._x > 0 else 0.0


@dataclass
class Decision:
    load: bool
    #: "learning" (too few samples), "faster", "slower", "explore" or "always".
    reason: str
    load_s: float = 0.0
    recompute_s: float = 0.0


class LoadPolicy:
    def __init__(self, block_size: int, mode: str = "when_faster", explore_every: int = 16,
                 decay: float = 0.97) -> None:
        if mode not in MODES:
            raise ValueError(f"load policy must be one of {', '.join(MODES)}, got {mode!r}")
        if block_size <= 0 or explore_every <= 0:
            raise ValueError("block_size and explore_every must be positive")
        self.block_size = block_size
        self.mode = mode
        self.explore_every = explore_every
        self.load = DecayingLine(decay)
        self.recompute = DecayingRatio(decay)
        self.refused = 0
        self.explored = 0

    def observe_load(self, blocks: int, seconds: float) -> None:
        if blocks > 0 and seconds >= 0.0:
            self.load.add(blocks, seconds)

    def observe_forward(self, tokens: int, seconds: float) -> None:
        """One forward step; only prefill steps (at least a block of tokens) count."""
        if tokens >= self.block_size and seconds >= 0.0:
            self.recompute.add(tokens, seconds)

    def decide(self, blocks: int) -> Decision:
        """Whether loading ``blocks`` blocks beats recomputing their tokens.

        >>> policy = LoadPolicy(block_size=16)
        >>> policy.decide(1).reason
        'learning'
        >>> for blocks in (1, 2, 3):  # 10 ms a load plus 1 ms a block
        ...     policy.observe_load(blocks, 0.010 + 0.001 * blocks)
        ...     policy.observe_forward(32, 0.032)  # 1 ms a token: 16 ms a block
        >>> d = policy.decide(2)
        >>> d.load, d.reason, round(d.load_s, 6), round(d.recompute_s, 6)
        (True, 'faster', 0.012, 0.032)
        """
        if self.mode == "always":
            return Decision(True, "always")
        if self.load.count < MIN_SAMPLES or self.recompute.count < MIN_SAMPLES:
            return Decision(True, "learning")
        load_s = self.load.predict(blocks)
        recompute_s = self.recompute.value() * blocks * self.block_size
        if load_s < recompute_s:
            return Decision(True, "faster", load_s, recompute_s)
        self.refused += 1
        if self.refused % self.explore_every == 0:
            self.explored += 1
            return Decision(True, "explore", load_s, recompute_s)
        return Decision(False, "slower", load_s, recompute_s)

    def describe(self) -> dict[str, float | int | str]:
        load_fixed, load_per_block = self.load.fit()
        return {"mode": self.mode, "load_fixed_s": load_fixed, "load_per_block_s": load_per_block,
                "recompute_per_token_s": self.recompute.value(), "load_samples": self.load.count,
                "forward_samples": self.recompute.count, "refused": self.refused, "explored": self.explored}
