"""What the KVRoutingPolicy follower reports about itself, for /readyz, /debug/state and metrics.

Kept apart from the follower so the runtime and the HTTP adapter read it without importing the
Kubernetes client.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class PolicyState:
    """The followed policy's watch: live or not, last applied generation, what was refused."""

    name: str  # NAMESPACE/NAME
    connected: bool = False
    generation: int = 0
    last_error: str | None = None  # the watch's
    unknown_fields: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # what the last applied policy had that was not taken
