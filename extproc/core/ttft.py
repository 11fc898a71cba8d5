"""Time to first token, predicted per backend from the prefill work a request finds ahead of it.

A request sent to a backend waits for the prefill already reserved there (every replica's) and
then computes its own uncached blocks. kvroute sees when that is done where it follows the
engine's progress: the KV events that store a request's blocks drain its reservation (load.py),
so each such request is one observation of (work blocks at dispatch, seconds until its prefill
was stored). Per backend the seconds are fitted as a line in the work, `a + b * work` (a: the
engine's fixed cost per request, tokenizing and scheduling; b: seconds per block of prefill in
the batches it runs), by least squares over decayed sums, so the last few dozen requests count
and a backend that slows down (longer batches, other tenants) is followed within them.

No prediction is made before `EVIDENCE` observations: admission then lets the request through
(fail open), counted as unpredicted. The same observations report the prediction's error.
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.95  # each observation keeps this share of the sums before it: about the last 20-40 count
EVIDENCE = 8  # observations of a backend before its predictions are acted on
MAX_SECONDS = 600.0  # an observation beyond this is a stalled or lost request, not a prefill


@dataclass(slots=True)
class _Fit:
    n: int = 0  # observations seen
    s0: float = 0.0  # decayed sums: weight, x, y, x*x, x*y
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float) -> None:
        self.n += 1
        self.s0 = DECAY * self.s0 + 1
        self.sx = DECAY * self.sx + x
        self.sy = DECAY * self.sy + y
        self.sxx = DECAY * self.sxx + x * x
        self.sxy = DECAY * self.sxy + x * y

    def line(self) -> tuple[float, float]:
        """(intercept, slope), both at least 0: more work never predicts less time."""
        mean_x, mean_y = self.sx / self.s0, self.sy / self.s0
        spread = self.sxx / self.s0 - mean_x * mean_x
        if spread <= 1e-9 * max(1.0, mean_x * mean_x):  # every request found the same work: a rate through 0
            return 0.0, mean_y / mean_x if mean_x > 0 else 0.0
        slope = max(0.0, (self.sxy / self.s0 - mean_x * mean_y) / spread)
        intercept = mean_y - slope * mean_x
        if intercept < 0:  # a line through the origin fits better than a negative fixed cost
            return 0.0, self.sxy / self.sxx
        return intercept, slope


class TTFTModel:
    """Per backend: the fitted line, and the error of the predictions it made."""

    __slots__ = ("_fits", "error_seconds", "observed", "predicted")

    def __init__(self) -> None:
        self._fits: dict[str, _Fit] = {}
        self.observed = 0  # observations (every request whose prefill kvroute saw stored)
        self.predicted = 0  # of those, made with a prediction at dispatch
        self.error_seconds = 0.0  # their summed absolute error

    def predict(self, backend: str, work_blocks: float) -> float | None:
        """Seconds until a request sent now with this much work (ahead of it plus its own) has
        its first token; None while the backend has too few observations."""
        fit = self._fits.get(backend)
        if fit is None or fit.n < EVIDENCE:
            return None
        intercept, slope = fit.line()
        return intercept + slope * work_blocks

    def observe(self, backend: str, work_blocks: float, seconds: float, predicted: float | None) -> None:
        """A request sent with this much work had its prefill stored after this many seconds."""
        if not 0 <= seconds <= MAX_SECONDS or work_blocks < 0:
            return
        fit = self._fits.get(backend)
        if fit is None:
            fit = self._fits[backend] = _Fit()
        fit.add(work_blocks, seconds)
        self.observed += 1
        if predicted is not None:
            self.predicted += 1
            self.error_seconds += abs(predicted - seconds)

    def forget(self, backend: str) -> None:
        self._fits.pop(backend, None)

    def clear(self) -> None:
        """Blocks changed meaning (another index mode or block size): every fit starts again."""
        self._fits.clear()

    def lines(self) -> dict[str, tuple[float, float]]:
        """backend -> (seconds, seconds per block) where predictions are made, for /debug/state."""
        return {b: f.line() for b, f in self._fits.items() if f.n >= EVIDENCE}
