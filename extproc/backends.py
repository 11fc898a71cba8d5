"""Backends: the vLLM servers a request may be sent to."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Backend:
    """One vLLM server. An empty `models` means it has not said, so it may serve any model."""

    address: str
    models: frozenset[str] = frozenset()
    healthy: bool = True

    def serves(self, model: str) -> bool:
        return self.healthy and (not self.models or model in self.models)
