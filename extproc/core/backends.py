"""Backends: the vLLM servers a request may be sent to."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from enum import StrEnum


class Role(StrEnum):
    """What a server does in a disaggregated fleet (llm-d's `llm-d.ai/role` values)."""

    BOTH = "both"  # whole requests, and either leg
    PREFILL = "prefill"  # prefill legs only
    DECODE = "decode"  # whole requests, and decode legs

    @classmethod
    def parse(cls, text: object) -> Role:
        """A role from a label, status or configuration value; ValueError if it names none."""
        try:
            return cls(str(text).strip().lower())
        except ValueError:
            raise ValueError(f"a backend role is one of {', '.join(r.value for r in cls)}, not {text!r}") from None


@dataclass(frozen=True, slots=True)
class Backend:
    """One vLLM server. An empty `models` means it has not said, so it may serve any model."""

    address: str
    models: frozenset[str] = frozenset()
    healthy: bool = True
    role: Role = Role.BOTH

    def serves(self, model: str) -> bool:
        return self.healthy and (not self.models or model in self.models)


def parse_address(text: str) -> str:
    """`ip:port` (IPv6 as `[ip]:port`), checked: routing must name exact, literal addresses."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"backend address must be ip:port, got {text!r}")
    ip = ipaddress.ip_address(host.strip("[]"))
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"
