"""Eight replicas against one router in the replay, over five seeds of the replicas' random turn
offsets (the single-offset figures swing by up to 0.1 between seeds). Run from the repository:
`python results/replicas-replay-35/turns.py > results/replicas-replay-35/turns-<change>.txt`."""

import statistics
from pathlib import Path

from bench.experiments.decisions import engine_hit_rate

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces" / "agents"
print("mode sessions backends lag one-router mean-of-8/1 min-of-8/1 per-seed")
for mode in ("precise", "approximate"):
    for name, backends in (("check", 4), ("check", 64), ("tune", 4), ("tune", 64)):
        path = TRACES / f"agent-{name}.jsonl"
        one = engine_hit_rate(path, 480, mode, backends=backends)
        for lag in (0, 4, 16):
            ratios = [
                engine_hit_rate(path, 480, mode, backends=backends, replicas=8, lag=lag, offsets=seed) / one
                for seed in range(5)
            ]
            row = [mode, name, backends, lag, f"{one:.4f}", f"{statistics.mean(ratios):.3f}", f"{min(ratios):.3f}"]
            print(*row, " ".join(f"{r:.3f}" for r in ratios), flush=True)
