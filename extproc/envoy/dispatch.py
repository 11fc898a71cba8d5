"""Several policies in one ext_proc: which policy's processor decides a request, by its model.

A policy serves the models its backends list (`KVRoutingPolicy.spec.models`, or each pod's
`kvroute.io/models`); a model several policies list goes to the first of them, in the order the
process was given. A LoRA adapter, served under its own name, which no policy's models list, goes
to the first policy one of whose engines lists or ran it (its adapter book). A model none lists goes
to the first policy with a backend that lists no model (such a backend serves any), else to the
first policy, whose router then finds no candidate (`no_candidates`): Envoy sends the request on
round robin and the engine answers its own 404.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from extproc.core.backends import Backend
    from extproc.envoy.processor import Processor, Stream


class PolicyDispatch:
    """Model -> the processor of the policy serving it; worked out again only when a policy's
    backend set changes (each pool keeps one tuple until then)."""

    def __init__(self, processors: Sequence[Processor]) -> None:
        if not processors:
            raise ValueError("dispatch needs at least one policy")
        self._processors = tuple(processors)
        # the backend sets it was worked out from, model -> processor, and the processor for a
        # model no policy lists: replaced as one, so a worker thread reads a consistent map
        self._map: tuple[tuple[tuple[Backend, ...], ...], dict[str, Processor], Processor] = ((), {}, processors[0])

    @property
    def processors(self) -> tuple[Processor, ...]:
        """Every policy's, in order."""
        return self._processors

    def refresh(self) -> None:
        """Work the map out again if a policy's backend set changed. On the event loop only: it
        reads the pools, whose views are not thread-safe."""
        current = tuple(p.pool.backends for p in self._processors)
        seen = self._map[0]
        if len(current) == len(seen) and all(a is b for a, b in zip(current, seen, strict=True)):
            return
        by_model: dict[str, Processor] = {}
        for processor, backends in zip(self._processors, current, strict=True):
            for backend in backends:
                for model in backend.models:
                    by_model.setdefault(model, processor)
        unlisted = next(
            (p for p, backends in zip(self._processors, current, strict=True) if any(not b.models for b in backends)),
            self._processors[0],
        )
        self._map = (current, by_model, unlisted)

    def owner(self, model: str) -> Processor:
        """The processor that decides a request for `model` ("": a request whose model is not
        known), by the map as `refresh` last left it. Safe from a worker thread."""
        _, by_model, unlisted = self._map
        found = by_model.get(model)
        if found is not None:
            return found
        return next((p for p in self._processors if p.router.adapters.adapter_of(model)), unlisted)

    def may_hold(self, stream: Stream) -> bool:
        """Whether some policy's flow control would hold a request arriving now (its model is not
        read yet): the request is then marked pending (Processor.request_headers)."""
        return any(p.may_hold(stream) for p in self._processors)

    def serving(self, model: str) -> Processor:
        """`owner`, on a map brought up to date first (on the event loop only)."""
        self.refresh()
        return self.owner(model)

    def slow_read_bytes(self) -> int:
        """Bodies above this are read off the loop: the smallest of the policies' limits (a body's
        model, and so its policy, is known only once it is read)."""
        return min(p.router.slow_read_bytes for p in self._processors)
