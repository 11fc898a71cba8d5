"""Time to first token, predicted per backend from the prefill work a request finds ahead of it.

A request sent to a backend waits for the prefill already reserved there (every replica's) and
then computes its own uncached blocks, in engine steps it shares with every request running
there. kvroute sees when that is done where it follows the engine's progress: the KV events that
store a request's blocks drain its reservation (load.py), so each such request is one
observation of (work blocks at dispatch, requests in flight there at dispatch, seconds until its
prefill was stored). Per backend the seconds are fitted as `a + b * work + c * in_flight` (a: the
engine's fixed cost per request, tokenizing and scheduling; b: seconds per block of prefill; c:
what each request sharing the steps adds) by least squares over decayed sums, so the last few
dozen requests count and a backend that slows down is followed within them. Where the two
inputs cannot be told apart (they moved together, or one never moved), or the fit would make
either cost negative, the line in the work alone is used.

What kvroute sees stored is the engine's prefill; a client waits longer (the server's front end
parses and tokenizes first, and a busy server streams the first token late). The engine's own
time to first token (`vllm:time_to_first_token_seconds`, from the request's arrival at its
server) comes with each load scrape: per backend, the ratio of its mean to the mean of kvroute's
observations over the same window (at least `WINDOW_REQUESTS` of each) scales the predictions,
decayed over windows, so a prediction is in the engine's seconds.

No prediction is made before `EVIDENCE` observations: admission then lets the request through
(fail open), counted as unpredicted. The same observations report the prediction's error.
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.95  # each observation keeps this share of the sums before it: about the last 20-40 count
EVIDENCE = 8  # observations of a backend before its predictions are acted on
MAX_SECONDS = 600.0  # an observation beyond this is a stalled or lost request, not a prefill
WINDOW_REQUESTS = 4  # first tokens the engine and kvroute each counted before a window's ratio is taken
SCALE_WEIGHT = 0.3  # a new window's share of the scale
SCALE_BOUNDS = (0.5, 20.0)  # a ratio outside these is a mismatch of windows, not a front end


@dataclass(slots=True)
class _Scale:
    """The engine's first-token counters at the window's start, and kvroute's own since then."""

    engine_sum: float
    engine_count: float
    own_sum: float = 0.0
    own_count: int = 0
    value: float = 1.0
    windows: int = 0

    def window(self, engine_sum: float, engine_count: float) -> None:
        """A new sample of the engine's counters: close the window once both sides counted enough."""
        count = engine_count - self.engine_count
        if count < 0 or engine_sum < self.engine_sum:  # a restart: start again from here
            self.engine_sum, self.engine_count, self.own_sum, self.own_count = engine_sum, engine_count, 0.0, 0
            return
        if count < WINDOW_REQUESTS or self.own_count < WINDOW_REQUESTS or self.own_sum <= 0:
            return
        ratio = ((engine_sum - self.engine_sum) / count) / (self.own_sum / self.own_count)
        ratio = min(max(ratio, SCALE_BOUNDS[0]), SCALE_BOUNDS[1])
        self.value = ratio if not self.windows else (1 - SCALE_WEIGHT) * self.value + SCALE_WEIGHT * ratio
        self.windows += 1
        self.engine_sum, self.engine_count, self.own_sum, self.own_count = engine_sum, engine_count, 0.0, 0


@dataclass(slots=True)
class _Fit:
    n: int = 0  # observations seen
    s0: float = 0.0  # decayed sums: weight; x (work), z (in flight), y (seconds); their products
    sx: float = 0.0
    sz: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxz: float = 0.0
    szz: float = 0.0
    sxy: float = 0.0
    szy: float = 0.0

    def add(self, x: float, z: float, y: float) -> None:
        self.n += 1
        d = DECAY
        self.s0 = d * self.s0 + 1
        self.sx = d * self.sx + x
        self.sz = d * self.sz + z
        self.sy = d * self.sy + y
        self.sxx = d * self.sxx + x * x
        self.sxz = d * self.sxz + x * z
        self.szz = d * self.szz + z * z
        self.sxy = d * self.sxy + x * y
        self.szy = d * self.szy + z * y

    def plane(self) -> tuple[float, float, float]:
        """(a, b, c) of `a + b * work + c * in_flight`, each at least 0."""
        w = self.s0
        mx, mz, my = self.sx / w, self.sz / w, self.sy / w
        cxx, czz, cxz = self.sxx / w - mx * mx, self.szz / w - mz * mz, self.sxz / w - mx * mz
        cxy, czy = self.sxy / w - mx * my, self.szy / w - mz * my
        det = cxx * czz - cxz * cxz
        if det > 1e-6 * max(1e-12, cxx * czz):
            b = (cxy * czz - czy * cxz) / det
            c = (czy * cxx - cxy * cxz) / det
            a = my - b * mx - c * mz
            if a >= 0 and b >= 0 and c >= 0:
                return a, b, c
        return (*self._line(mx, my, cxx, cxy), 0.0)

    def _line(self, mx: float, my: float, spread: float, cov: float) -> tuple[float, float]:
        """(a, b) of the line in the work alone, both at least 0."""
        if spread <= 1e-9 * max(1.0, mx * mx):  # every request found the same work: a rate through 0
            return 0.0, my / mx if mx > 0 else 0.0
        slope = max(0.0, cov / spread)
        intercept = my - slope * mx
        if intercept < 0:  # a line through the origin fits better than a negative fixed cost
            return 0.0, self.sxy / self.sxx
        return intercept, slope


class TTFTModel:
    """Per backend: the fitted line, and the error of the predictions it made."""

    __slots__ = ("_fits", "_scales", "error_seconds", "observed", "predicted")

    def __init__(self) -> None:
        self._fits: dict[str, _Fit] = {}
        self._scales: dict[str, _Scale] = {}
        self.observed = 0  # observations (every request whose prefill kvroute saw stored)
        self.predicted = 0  # of those, made with a prediction at dispatch
        self.error_seconds = 0.0  # their summed absolute error

    def predict(self, backend: str, work_blocks: float, in_flight: int) -> float | None:
        """Seconds until a request sent now with this much work (ahead of it plus its own), beside
        `in_flight` other requests there, has its first token; None while the backend has too few
        observations."""
        fit = self._fits.get(backend)
        if fit is None or fit.n < EVIDENCE:
            return None
        a, b, c = fit.plane()
        return (a + b * work_blocks + c * in_flight) * self.scale(backend)

    def scale(self, backend: str) -> float:
        """The engine's first-token time over kvroute's view of the prefill, at this backend."""
        scale = self._scales.get(backend)
        return 1.0 if scale is None else scale.value

    def engine(self, backend: str, ttft_sum: float, ttft_count: float) -> None:
        """The engine's own first-token counters, from one sample of its /metrics."""
        scale = self._scales.get(backend)
        if scale is None:
            self._scales[backend] = _Scale(ttft_sum, ttft_count)
        else:
            scale.window(ttft_sum, ttft_count)

    def observe(
        self, backend: str, work_blocks: float, in_flight: int, seconds: float, predicted: float | None
    ) -> None:
        """A request sent with this much work, beside `in_flight` others, had its prefill stored
        after this many seconds."""
        if not 0 <= seconds <= MAX_SECONDS or work_blocks < 0 or in_flight < 0:
            return
        fit = self._fits.get(backend)
        if fit is None:
            fit = self._fits[backend] = _Fit()
        fit.add(work_blocks, in_flight, seconds)
        self.observed += 1
        scale = self._scales.get(backend)
        if scale is not None:
            scale.own_sum += seconds
            scale.own_count += 1
        if predicted is not None:  # scored in the engine's seconds, as predicted
            self.predicted += 1
            self.error_seconds += abs(predicted - seconds * self.scale(backend))

    def forget(self, backend: str) -> None:
        self._fits.pop(backend, None)
        self._scales.pop(backend, None)

    def clear(self) -> None:
        """Blocks changed meaning (another index mode or block size): every fit starts again."""
        self._fits.clear()

    def planes(self) -> dict[str, tuple[float, float, float]]:
        """backend -> (seconds, per block, per request in flight) where predictions are made."""
        return {b: f.plane() for b, f in self._fits.items() if f.n >= EVIDENCE}
