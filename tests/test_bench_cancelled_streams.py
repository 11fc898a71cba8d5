"""`kvroute-dev bench cancelled-streams` runs both stream endings against a bare grpc.aio server
(a smoke test with a few streams; the per-stream figure is a benchmark's, not asserted)."""

from __future__ import annotations

import pytest

from bench.experiments import cancelled_streams

pytestmark = pytest.mark.bench


@pytest.mark.parametrize("server_kind", list(cancelled_streams.SERVERS))
@pytest.mark.parametrize("cancel", [False, True])
def test_both_stream_endings_are_driven_and_sampled(cancel: bool, server_kind: str):
    result = cancelled_streams.measure(400, cancel, steps=2, server_kind=server_kind)
    assert result["end"] == ("cancel" if cancel else "half-close") and result["server"] == server_kind
    assert [streams for streams, _ in result["rss_mib_by_streams"]] == [200, 400]
    assert all(rss > 10 for _, rss in result["rss_mib_by_streams"])  # a live Python process's RSS, in MiB
