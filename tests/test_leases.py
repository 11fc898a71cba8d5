"""Leases: lifecycles held for HTTP gateways end exactly once, by release or by expiry."""

from __future__ import annotations

from extproc.core.backends import Backend
from extproc.core.leases import LeaseTable
from extproc.core.request import parse_request
from extproc.core.router import Router
from extproc.core.settings import Settings

A = "10.0.0.1:8000"


def begin(router: Router):
    request = parse_request({"model": "m", "messages": [{"role": "user", "content": "x" * 2000}]})
    return router.begin(request, [Backend(A)], 0.0)


def test_close_ends_the_exchange_once_and_forgets_the_lease():
    router = Router(Settings(hash_key=bytes(16)))
    leases = LeaseTable(ttl_s=10)
    lease = leases.open(begin(router), 0.0)
    assert router.loads.snapshot()[A][1] == 1
    assert leases.close(lease) is not None and router.loads.snapshot()[A] == (0, 0)
    assert leases.close(lease) is None and leases.get(lease) is None


def test_expiry_ends_only_leases_past_their_deadline_oldest_first():
    router = Router(Settings(hash_key=bytes(16)))
    leases = LeaseTable(ttl_s=10)
    old = leases.open(begin(router), 0.0)
    young = leases.open(begin(router), 5.0)
    assert leases.expire(9.9) == 0
    assert leases.expire(10.0) == 1 and leases.get(old) is None and leases.get(young) is not None
    assert router.loads.snapshot()[A][1] == 1
    assert leases.expire(100.0) == 1 and router.loads.snapshot()[A] == (0, 0)


def test_the_table_is_bounded_and_ids_are_unguessable():
    router = Router(Settings(hash_key=bytes(16)))
    leases = LeaseTable(ttl_s=10, capacity=2)
    ids = {leases.open(begin(router), 0.0) for _ in range(2)}
    assert leases.full() and len(ids) == 2 and all(len(i) >= 20 for i in ids)
