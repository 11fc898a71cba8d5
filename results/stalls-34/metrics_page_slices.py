"""A 4 MiB metrics page of gauge lines read by the scraper in slices (the event loop's longest
stall between two turns) against read at once. From the repository root:
.venv/bin/python results/stalls-34/metrics_page_slices.py"""

import asyncio
import time

from extproc.vllm import scraper
from extproc.vllm.metrics import engine_sample

LINES = b"".join(b'vllm:num_requests_running{engine="%d"} 1\n' % i for i in range(110_000))
PAGE = LINES[: LINES.rfind(b"\n", 0, 4 << 20) + 1]


async def sliced() -> None:
    gaps: list[float] = []
    last = time.perf_counter()

    async def tick() -> None:
        nonlocal last
        while True:
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
            await asyncio.sleep(0)

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0)
    started = time.perf_counter()
    await scraper._sample_of(PAGE)
    total = time.perf_counter() - started
    ticker.cancel()
    print(f"sliced: total {total * 1e3:.1f} ms, longest stall {max(gaps) * 1e3:.2f} ms over {len(gaps)} turns")


for _ in range(3):
    asyncio.run(sliced())
started = time.perf_counter()
engine_sample(PAGE.decode())
print(f"at once: {(time.perf_counter() - started) * 1e3:.1f} ms")
