"""Several policies in one ext_proc: which policy's processor decides a request, by its model.

A policy serves the models its backends list (`KVRoutingPolicy.spec.models`, or each pod's
`kvroute.io/models`); a model several policies list goes to the first of them, in the order the
process was given. A model none lists goes to the first policy with a backend that lists no model
(such a backend serves any), else to the first policy, whose router then finds no candidate
(`no_candidates`): Envoy sends the request on round robin and the engine answers its own 404.
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
        self._seen: tuple[tuple[Backend, ...], ...] = ()
        self._by_model: dict[str, Processor] = {}
        self._any = self._processors[0]

    @property
    def processors(self) -> tuple[Processor, ...]:
        """Every policy's, in order."""
        return self._processors

    def owner(self, model: str) -> Processor:
        """The processor that decides a request for `model`."""
        current = tuple(p.pool.backends for p in self._processors)
        if len(current) != len(self._seen) or any(a is not b for a, b in zip(current, self._seen, strict=True)):
            self._rebuild(current)
        return self._by_model.get(model, self._any)

    def _rebuild(self, current: tuple[tuple[Backend, ...], ...]) -> None:
        by_model: dict[str, Processor] = {}
        for processor, backends in zip(self._processors, current, strict=True):
            for backend in backends:
                for model in backend.models:
                    by_model.setdefault(model, processor)
        self._any = next(
            (p for p, backends in zip(self._processors, current, strict=True) if any(not b.models for b in backends)),
            self._processors[0],
        )
        self._by_model, self._seen = by_model, current

    def may_hold(self, stream: Stream) -> bool:
        """Whether some policy's flow control would hold a request arriving now (its model is not
        read yet): the request is then marked pending (Processor.request_headers)."""
        return any(p.may_hold(stream) for p in self._processors)

    def precise(self) -> bool:
        """Some policy tokenizes (precise mode): bodies are then read off the loop from a smaller size."""
        return any(p.router.precise for p in self._processors)
