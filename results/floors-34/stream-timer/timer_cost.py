"""What asyncio.timeout costs a stream: the ext_proc path wraps each gRPC stream in one
(max_stream_age_s). Run: .venv/bin/python results/floors-34/stream-timer/timer_cost.py"""

import asyncio
import time

REPEATS = 200_000


async def main() -> None:
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(REPEATS):
            async with asyncio.timeout(3600.0):
                pass
        timed = (time.perf_counter() - started) / REPEATS * 1e6
        started = time.perf_counter()
        for _ in range(REPEATS):
            pass
        empty = (time.perf_counter() - started) / REPEATS * 1e6
        print(f"asyncio.timeout enter+exit {timed:.2f} us, empty loop {empty:.2f} us")


asyncio.run(main())
