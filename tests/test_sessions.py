"""Sessions: key derivation precedence, TTL, capacity, removal."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core.sessions import EXPIRE_SLICE, NO_CONTEXT, SessionTable, context_of, continued, derive_session_key


@pytest.mark.parametrize(
    ("headers", "body", "key"),
    [
        ({"x-session-id": "h"}, {"session_id": "b", "user": "u"}, "session:h"),
        ({}, {"session_params": {"session_id": "p"}, "session_id": "b"}, "session:p"),
        ({}, {"session_id": "b", "user": "u"}, "session:b"),
        ({}, {"session_id": 42}, "session:42"),
        ({"x-user-id": "hu"}, {"user": "u"}, "user:u"),
        ({"x-user-id": "hu"}, {"user_id": "ui"}, "user:ui"),
        ({"x-user-id": "hu"}, {}, "user:hu"),
        ({"x-request-id": "r", "x-trace-id": "t"}, {}, None),
        ({"x-session-id": ""}, {"session_id": True, "user": ["x"]}, None),
    ],
)
def test_session_key_derivation(headers, body, key):
    assert derive_session_key(headers, body) == key


def test_session_and_user_namespaces_do_not_collide():
    assert derive_session_key({"x-session-id": "a"}, {}) != derive_session_key({}, {"user": "a"})


def test_bindings_expire_and_are_dropped():
    table = SessionTable(ttl_s=10, capacity=10, key=bytes(16))
    table.bind("s1", "A", 0)
    assert table.get("s1", 9) == "A"
    assert table.get("s1", 11) is None
    assert len(table) == 0


def test_after_a_quiet_spell_expired_bindings_go_a_slice_per_bind_and_are_never_answered():
    """The first bind after more than a TTL without traffic would drop every binding at once (20 ms
    for 100,000); each bind drops EXPIRE_SLICE, and an expired binding answers nothing meanwhile."""
    table = SessionTable(ttl_s=10, capacity=10 * EXPIRE_SLICE, key=bytes(16))
    for i in range(2 * EXPIRE_SLICE + 5):
        table.bind(f"s{i}", "A", 0)
    table.bind("new", "B", 20)
    assert len(table) == EXPIRE_SLICE + 5 + 1
    assert table.get("s0", 20) is None and table.get(f"s{2 * EXPIRE_SLICE + 4}", 20) is None
    table.bind("new", "B", 21)
    table.bind("new", "B", 22)
    assert len(table) == 1 and table.get("new", 22) == "B"


def test_use_refreshes_binding():
    table = SessionTable(ttl_s=10, capacity=10, key=bytes(16))
    table.bind("s1", "A", 0)
    table.bind("s1", "A", 8)
    assert table.get("s1", 15) == "A"


def test_capacity_evicts_least_recently_bound():
    table = SessionTable(ttl_s=100, capacity=2, key=bytes(16))
    table.bind("s1", "A", 0)
    table.bind("s2", "A", 1)
    table.bind("s1", "B", 2)
    table.bind("s3", "A", 3)
    assert (table.get("s1", 4), table.get("s2", 4), table.get("s3", 4)) == ("B", None, "A")


def test_similar_keys_are_distinct():
    table = SessionTable(ttl_s=100, capacity=10, key=bytes(16))
    table.bind("session:session-1", "A", 0)
    table.bind("session:session-12", "B", 0)
    assert table.get("session:session-1", 1) == "A"
    assert table.get("session:session-12", 1) == "B"


def test_remove_backend_and_forget():
    table = SessionTable(ttl_s=100, capacity=10, key=bytes(16))
    table.bind("s1", "A", 0)
    table.bind("s2", "B", 0)
    assert table.remove_backend("A") == 1
    assert table.get("s1", 1) is None
    assert table.forget("s2") and not table.forget("s2")


def test_a_backend_that_left_loses_its_bindings_and_a_return_brings_none_back():
    table = SessionTable(ttl_s=100, capacity=10, key=bytes(16))
    for i in range(6):
        table.bind(f"s{i}", "ABC"[i % 3], 0)
    table.bind("late", "B", 10)
    table.leave("A")
    assert len(table) == 5 and table.get("s0", 1) is None
    table.bind("s9", "A", 2)  # back: its old bindings are not its any more
    assert table.get("s3", 3) is None and table.get("s9", 3) == "A" and len(table) == 6
    table.leave("B")
    table.bind_digest(table._digest("late"), "C", 5)  # older than the binding it replaces, which went
    assert table.get("late", 6) == "C"


class _Unscannable(OrderedDict):
    """A table that refuses to be walked: what a pass over every binding would do."""

    def __iter__(self):
        raise AssertionError("a pass over the whole table")

    def items(self):
        raise AssertionError("a pass over the whole table")

    keys = values = items


def test_a_reset_or_a_departure_touches_only_that_backends_bindings():
    """A cache reset or a departure goes through the backend's own bindings, never the whole
    table (at 100,000 bindings a pass took 15 ms a backend: a fleet clearing or restarting its
    caches paid it once per backend)."""
    table = SessionTable(ttl_s=10_000, capacity=1000, key=bytes(16))
    for i in range(300):
        table.bind(f"s{i}", f"10.0.0.{i % 30}:8000", i)
    table._bindings = _Unscannable(table._bindings)
    assert table.remove_backend("10.0.0.1:8000", before=150) == 5  # s1, s31, ..., s121: used by 150
    assert table.get("s1", 300) is None and table.get("s151", 300) == "10.0.0.1:8000"
    assert table.remove_backend("10.0.0.1:8000") == 5 and table.remove_backend("10.0.0.1:8000") == 0
    table.leave("10.0.0.2:8000")
    assert len(table) == 280 and table.get("s2", 300) is None and table.get("s3", 300) == "10.0.0.3:8000"


def test_configured_session_headers_come_first_in_order():
    headers = {"x-conversation": "c", "x-session-id": "s"}
    assert derive_session_key(headers, {}, ("x-conversation", "x-session-id")) == "session:c"
    assert derive_session_key(headers, {}, ("x-other",)) is None
    assert derive_session_key(headers, {"session_id": "b"}, ("x-other",)) == "session:b"


def test_configure_shrinks_capacity_oldest_first():
    table = SessionTable(ttl_s=100, capacity=3, key=bytes(16))
    for i in range(3):
        table.bind(f"s{i}", "A", i)
    table.configure(ttl_s=100, capacity=1, key=bytes(16))
    assert (table.get("s0", 5), table.get("s2", 5)) == (None, "A")


def test_long_identifiers_are_not_sessions_and_keys_are_stored_as_keyed_digests():
    huge = "u" * (256 * 1024)
    assert derive_session_key({}, {"user": huge}) is None
    assert derive_session_key({"x-session-id": huge}, {"user": "alice"}) == "user:alice"
    table = SessionTable(ttl_s=100, capacity=10, key=b"k" * 16)
    table.bind("session:" + "s" * 500, "10.0.0.1:8000", 0)
    stored = next(iter(table._bindings))
    assert isinstance(stored, bytes) and len(stored) == 16 and b"sss" not in stored
    assert table.get("session:" + "s" * 500, 1) == "10.0.0.1:8000"
    other = SessionTable(ttl_s=100, capacity=10, key=b"j" * 16)
    other.bind("session:" + "s" * 500, "10.0.0.1:8000", 0)
    assert next(iter(other._bindings)) != stored  # another key, another digest
    table.configure(100, 10, b"j" * 16)  # a new key: old digests are unreachable, so they go
    assert len(table) == 0


def test_a_tenant_header_scopes_session_ids():
    a = derive_session_key({"x-session-id": "s1", "x-tenant": "a"}, {}, ("x-session-id",), "x-tenant")
    b = derive_session_key({"x-session-id": "s1", "x-tenant": "b"}, {}, ("x-session-id",), "x-tenant")
    assert a != b and a.endswith("session:s1")
    assert derive_session_key({"x-session-id": "s1"}, {}, ("x-session-id",), "") == "session:s1"
    # a tenant value too long to keep stays its own tenant (it once fell into the unnamed one's)
    keys = {
        derive_session_key({"x-session-id": "s1", **tenant}, {}, ("x-session-id",), "x-tenant")
        for tenant in ({}, {"x-tenant": "t" * 600}, {"x-tenant": "t" * 601})
    }
    assert len(keys) == 3 and all(key is not None and len(key) < 600 for key in keys)


def test_a_binding_remembers_the_last_prompt_by_its_size_and_last_block():
    table = SessionTable(ttl_s=10, capacity=10, key=bytes(16))
    table.bind("s1", "A", 0, context_of([7, 8, 42]))
    assert table.binding("s1", 1) == ("A", (3, 42)) and table.get("s1", 1) == "A"
    table.bind_digest(table.bind("s2", "B", 0), "C", 1)  # a sibling's binding: the prompt is not known here
    assert table.binding("s2", 2) == ("C", NO_CONTEXT)
    assert table.binding("s1", 11) is None  # expired


def test_a_prompt_continues_the_last_one_only_through_its_last_block():
    last = context_of([1, 2, 3])
    assert continued(last, [1, 2, 3]) == 3 and continued(last, [1, 2, 3, 4, 5]) == 3  # the same, or longer
    assert continued(last, [1, 2, 9, 4]) == 0  # it differs at the last block: a prompt that does not extend it
    assert continued(last, [1, 2]) == 0  # shorter
    assert continued(NO_CONTEXT, [1, 2, 3]) == 0 and continued(context_of([]), [1]) == 0  # not known


class EagerSessions:
    """The reference: bindings dropped the moment their backend leaves, as before `leave`."""

    def __init__(self, ttl: float, capacity: int) -> None:
        self.ttl, self.capacity = ttl, capacity
        self.bindings: dict[str, tuple[str, float]] = {}  # in last-use order

    def bind(self, key: str, backend: str, now: float) -> None:
        held = self.bindings.get(key)
        if held is not None and held[1] > now:  # older news changes nothing
            return
        self.bindings.pop(key, None)
        self.bindings[key] = (backend, now)
        while len(self.bindings) > self.capacity:
            del self.bindings[next(iter(self.bindings))]

    def get(self, key: str, now: float) -> str | None:
        held = self.bindings.get(key)
        if held is not None and held[1] < now - self.ttl:  # expired: dropped when asked, as the table
            del self.bindings[key]  # does (until then it counts towards the capacity)
            return None
        return None if held is None else held[0]

    def leave(self, backend: str, before: float = float("inf")) -> None:
        self.bindings = {k: v for k, v in self.bindings.items() if v[0] != backend or v[1] > before}

    def forget(self, key: str) -> bool:
        return self.bindings.pop(key, None) is not None


OPERATIONS = st.lists(
    st.tuples(
        st.sampled_from(["bind", "bind", "bind", "sibling", "leave", "reset", "forget", "get"]),
        st.integers(0, 3),  # session
        st.sampled_from("ABC"),  # backend
        st.integers(-4, 4),  # time step; for a sibling's binding, how much older it is
    ),
    min_size=6,
    max_size=60,
)


@settings(max_examples=500)
@given(OPERATIONS, st.integers(1, 3))
def test_the_table_answers_as_one_that_drops_at_once_and_lists_each_backends_bindings(operations, capacity):
    """Whatever is bound, replaced by siblings, forgotten, reset, left, come back or pushed out by
    capacity, the table answers as a plain model that drops bindings at once, and its listing by
    backend names exactly the bindings it holds."""
    table, model = SessionTable(ttl_s=10, capacity=capacity, key=bytes(16)), EagerSessions(10, capacity)
    now = 0.0
    for op, session, backend, step in operations:
        now += 0 if op == "sibling" else max(0, step)  # this replica's clock never goes back
        key = f"s{session}"
        if op in ("bind", "sibling"):
            when = now - abs(step) if op == "sibling" else now  # a sibling's news may be older
            if op == "sibling":
                table.bind_digest(table._digest(key), backend, when)
            else:
                table.bind(key, backend, when)
            model.bind(key, backend, when)
        elif op == "leave":
            table.leave(backend)
            model.leave(backend)
        elif op == "reset":  # emptied some time after `now - step`
            table.remove_backend(backend, now - abs(step))
            model.leave(backend, now - abs(step))
        elif op == "forget":  # (what it returns may differ: the table drops expired bindings as it binds)
            table.forget(key)
            model.forget(key)
        else:  # asking meets an expired binding, which drops it
            assert table.get(key, now) == model.get(key, now)
        listed = {(digest, name) for name, digests in table._by_backend.items() for digest in digests}
        assert all(table._by_backend.values())
        assert listed == {(digest, held[0]) for digest, held in table._bindings.items()}
    assert [table.get(f"s{i}", now) for i in range(4)] == [model.get(f"s{i}", now) for i in range(4)]
