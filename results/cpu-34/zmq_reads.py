"""CPU a process spends per KV event batch it reads, by how it reads them: pyzmq's asyncio socket
(one await per batch) against the subscriber's bursts (`extproc.vllm.subscriber._bursts`). A
publisher in another process sends 5,000 batches of 6,000 bytes, one every 2 ms (a busy engine
sends one per step). Usage: .venv/bin/python results/cpu-34/zmq_reads.py"""

import asyncio
import multiprocessing
import os
import socket
import time

import zmq
import zmq.asyncio

from extproc.vllm import subscriber

BATCHES = 5000
PAYLOAD = os.urandom(6000)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def publish(port: int) -> None:
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    time.sleep(0.5)  # the subscriber connects
    for i in range(BATCHES):
        pub.send_multipart([b"kv", i.to_bytes(8, "big"), PAYLOAD])
        time.sleep(0.002)
    pub.send_multipart([b"kv", b"end", b""])
    time.sleep(0.5)


async def count(messages) -> float:
    read, started = 0, None
    async for frames in messages:
        if started is None:
            started = time.process_time()
        if frames[1] == b"end":
            return (time.process_time() - started) / read
        read += 1
    raise AssertionError("the stream ended")


async def awaited(sock: zmq.asyncio.Socket):
    while True:
        yield await sock.recv_multipart()


async def run(kind: str, port: int) -> float:
    context = zmq.asyncio.Context()
    if kind == "asyncio socket":
        sock = context.socket(zmq.SUB)
        messages = awaited(sock)
    else:
        sock = zmq.Socket(context, zmq.SUB)
        messages = subscriber._bursts(sock, lambda: 0.02)  # the gap these figures were taken with
    sock.setsockopt(zmq.SUBSCRIBE, b"kv")
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        return await count(messages)
    finally:
        sock.close(linger=0)
        context.destroy(linger=0)


if __name__ == "__main__":
    for kind in ("asyncio socket", "bursts", "asyncio socket", "bursts"):
        port = free_port()
        publisher = multiprocessing.Process(target=publish, args=(port,))
        publisher.start()
        per_batch = asyncio.run(run(kind, port))
        publisher.join()
        print(f"{kind:15} {per_batch * 1e6:6.1f} µs of CPU a batch (the reading process, ZMQ's I/O thread included)")
