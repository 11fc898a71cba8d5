"""N full request lifecycles of bench core's 8 KB, 10 k-entry case, for counting instructions:
valgrind --tool=callgrind --callgrind-out-file=/dev/null python lifecycles.py N, for N = 0 and
1000 with PYTHONHASHSEED=0; the difference / 1000 is one lifecycle's instructions (repeatable to
the instruction, unlike time on this machine). Runs against either tree (bench.core before issue 29)."""

import random
import sys

try:
    from bench.experiments import core
except ImportError:
    import bench.core as core
N = int(sys.argv[1])
S = core.Settings(block_size=512, hash_key=b"k" * 16, capacity_blocks=2500 + 100_000, location_ttl_s=1e9)
r = core.Router(S)
core._fill(r, 10_000, random.Random(1))
warm = core.parse_request(core.orjson.dumps(core.conversation(8000, seed=8000)))
r.learn(warm, core.BACKENDS[0].address, 1.0)
bodies = list(core._bodies(8000, max(N, 1)))
for i in range(N):
    core._decide(r, bodies[i], 2.0 + i)
