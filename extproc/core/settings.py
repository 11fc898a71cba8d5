"""Routing settings, each declared once: name, type, default, bounds, help and policy field.

Everything else is derived from these declarations: validation here, the config file /
environment / flag layer (extproc/runtime/config.py), the KVRoutingPolicy `spec.routing` fields
operator and follower accept (policy.py), and the generated docs/settings.md and CRD schema
(tools/).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from extproc.core.adapters import valid_name

# Every number a setting takes is at most this unless it declares less: products of settings past
# it reach infinity, and 0 * infinity is NaN (activeRequestCost 1e308 with newSessionLoadWeight 0
# left no cheapest candidate, an error on every request).
MAX_SETTING = 10**12


@dataclass(frozen=True, slots=True)
class Bounds:
    """Inclusive or exclusive limits of a numeric setting (None: unbounded below)."""

    minimum: float | None = None
    exclusive_minimum: bool = False
    maximum: float = MAX_SETTING
    multiple_of: int | None = None

    def check(self, name: str, value: float) -> None:
        if value != value:  # NaN: every comparison below would let it through
            raise ValueError(f"{name} must be a number, got {value}")
        if self.minimum is not None:
            low = value <= self.minimum if self.exclusive_minimum else value < self.minimum
            if low:
                word = "greater than" if self.exclusive_minimum else "at least"
                raise ValueError(f"{name} must be {word} {self.minimum}, got {value}")
        if value > self.maximum:
            raise ValueError(f"{name} must be at most {self.maximum}, got {value}")
        if self.multiple_of is not None and value % self.multiple_of:
            raise ValueError(f"{name} must be a multiple of {self.multiple_of}, got {value}")


def check_kind(name: str, kind: type, value: Any) -> None:
    """A setting's value is of its type (a YAML file or a policy hands values over as they are
    written: `"false"` is true, 512.0 no block count, a key left blank None): booleans are
    booleans, whole numbers whole, other numbers finite, text text."""
    if kind is str and not isinstance(value, str):
        raise ValueError(f"{name} must be text, got {value!r}")
    if kind is bool and not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    if kind is float and (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def check_value(name: str, kind: type, bounds: Bounds | None, value: Any) -> None:
    """A declared value's kind, then its bounds: what every setting and process key is held to."""
    check_kind(name, kind, value)
    if bounds is not None:
        bounds.check(name, value)


POSITIVE = Bounds(minimum=0, exclusive_minimum=True)
NON_NEGATIVE = Bounds(minimum=0)
SESSION_HEADERS = ("x-session-id",)  # the default conversation header (Envoy forwards it: envoy/bootstrap.py)
HEADER_NAME = "[A-Za-z0-9!#$%&'*+.^_`|~-]+"  # an HTTP header name (RFC 9110 token)
AUTO = "auto"  # capacityBlocks in a policy: size each backend from its own metrics (capacity_auto)


def parse_flag(text: str) -> bool:
    """A boolean from text (environment, flags)."""
    if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(f"expected true or false, got {text!r}")
    return text.lower() in ("true", "1", "yes")


def parse_names(text: str) -> tuple[str, ...]:
    """A comma-separated list from text."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _header(name: object, setting: str) -> str:
    if not isinstance(name, str) or not re.fullmatch(HEADER_NAME, name):
        raise ValueError(f"{setting} must be HTTP header names, got {name!r}")
    return name.lower()  # HTTP/2 and Envoy carry header names in lower case


def _header_names(value: Any) -> tuple[str, ...]:
    """A list of header names (empty: only the body names conversations)."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"session_headers must be a list of header names, got {value!r}")
    return tuple(_header(name, "session_headers") for name in value)


MAX_METRIC_FLOWS = 32  # flows named in metric labels at most (queue_metric_flows)
MAX_FLOW_ID = 128  # a longer flow id is replaced by a digest of it (objectives.py)
MAX_QUEUE_FLOWS = 1024  # flows tracked per priority band at most (queue_max_flows; what replicas accept)
MAX_OUTPUT_COST = 1 << 20  # output tokens a request's flow-control cost counts at most


def _flow_names(value: Any) -> tuple[str, ...]:
    """Flow ids to name in metrics: a short list of short names."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"queue_metric_flows must be a list of flow ids, got {value!r}")
    if len(value) > MAX_METRIC_FLOWS or not all(isinstance(v, str) and 0 < len(v) <= MAX_FLOW_ID for v in value):
        raise ValueError(f"queue_metric_flows: at most {MAX_METRIC_FLOWS} flow ids of 1-{MAX_FLOW_ID} characters")
    return tuple(value)


MAX_PAIRS = 256  # entries of a name -> number setting (flow_weights, objective_priorities)


def parse_pairs(text: str) -> tuple[tuple[str, str], ...]:
    """`name=number,name=number` from text (environment, flags); the numbers are checked later."""
    pairs = []
    for item in parse_names(text):
        name, equals, number = item.partition("=")
        if not equals:
            raise ValueError(f"expected name=number, got {item!r}")
        pairs.append((name.strip(), number.strip()))
    return tuple(pairs)


def _pairs(
    setting: str,
    cast: Callable[[Any], Any],
    check: Callable[[Any], bool],
    what: str,
    named: Callable[[str], bool] = bool,
) -> Callable[[Any], Any]:
    """A name -> value setting (a number, or a path), held as sorted (name, value) pairs so
    Settings stays hashable; from a mapping (YAML, a policy) or pairs (text). `named`: what else a
    name must be."""

    def normalize(value: Any) -> tuple[tuple[str, Any], ...]:
        items: Any = list(value.items()) if isinstance(value, dict) else value
        if isinstance(items, str) or not isinstance(items, (list, tuple)):
            raise ValueError(f"{setting} must map names to values, got {value!r}")
        out = {}
        pair: Any
        for pair in items:
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise ValueError(f"{setting} must map names to values, got {value!r}")
            name, number = pair
            if not isinstance(name, str) or not 0 < len(name) <= MAX_FLOW_ID or isinstance(number, bool):
                raise ValueError(f"{setting}: names of 1-{MAX_FLOW_ID} characters, got {name!r}")
            if not named(name):
                raise ValueError(f"{setting}: {name!r} is not shaped like a model id (as vLLM names an adapter)")
            try:
                number = cast(number)
            except (TypeError, ValueError):
                raise ValueError(f"{setting}[{name}] must be {what}, got {number!r}") from None
            if not check(number):
                raise ValueError(f"{setting}[{name}] must be {what}, got {number!r}")
            out[name] = number
        if len(out) > MAX_PAIRS:
            raise ValueError(f"{setting}: at most {MAX_PAIRS} entries")
        return tuple(sorted(out.items()))

    return normalize


def _adapter_path(value: Any) -> str:
    """Where the servers find an adapter (vLLM's lora_path): a non-empty string, bounded."""
    if not isinstance(value, str) or not 0 < len(value) <= 4096:
        raise ValueError(value)
    return value


def _int(value: Any) -> int:
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(value)
    return int(value)


def _tenant_header(value: Any) -> str:
    return "" if value == "" else _header(value, "tenant_header")


def _hex_key(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise ValueError("hash_key must be 32 hex digits") from None


def _blocks_or_auto(value: Any) -> dict[str, Any]:
    """capacityBlocks: a number of blocks, or "auto". The number is checked with the settings (1.5
    or true is no block count, where int() made them 1)."""
    if value == AUTO:
        return {"capacity_auto": True}
    return {"capacity_auto": False, "capacity_blocks": value}


_PARSERS: dict[type, Callable[[str], Any]] = {bool: parse_flag, int: int, float: float, str: str, tuple: parse_names}


def text_parser(kind: type) -> Callable[[str], Any]:
    """How a value of this type is read from text (environment, flags)."""
    return _PARSERS[kind]


def _setting(
    default: Any,
    text: str,
    bounds: Bounds | None = None,
    policy: str | None = None,
    choices: tuple[str, ...] = (),
    *,
    normalize: Callable[[Any], Any] | None = None,
    parse: Callable[[str], Any] | None = None,
    policy_value: Callable[[Any], dict[str, Any]] | None = None,
    schema: str | None = None,
    secret: bool = False,
    kind: type | None = None,
) -> Any:
    """One declared setting and every rule that applies to it, whatever its source:
    - `policy`: its KVRoutingPolicy spec.routing field, if exposed; `policy_value`: how a policy's
      value becomes settings (default: this setting, as given);
    - `choices`: the values a text setting may take (none: free text);
    - `normalize`: the canonical form of a value from any source (YAML, environment, flags, a
      policy), applied on construction; raises ValueError on a value it cannot take;
    - `parse`: text (environment, flags) -> value (default: by the default's type);
    - `schema`: the policy schema's kind where the type does not say it ("header", "headers",
      "path", "blocks_or_auto"; tools/crd.py);
    - `secret`: never shown (/debug/state) nor read from a policy;
    - `kind`: the value's type, where the default is made per process (a factory)."""
    kind = kind or type(default)
    metadata = {
        "help": text,
        "bounds": bounds,
        "policy": policy,
        "choices": choices,
        "normalize": normalize,
        "kind": kind,
        "parse": parse or text_parser(kind),
        "policy_value": policy_value,
        "schema": schema,
        "secret": secret,
    }
    if callable(default):
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True, slots=True)
class Settings:
    """All routing settings. Validated on construction so a bad config fails at start-up."""

    block_size: int = _setting(
        512,
        "Bytes of canonical prompt per block (multiple of 8); ~128 tokens, vLLM's CPU KV block.",
        Bounds(minimum=8, maximum=1 << 20, multiple_of=8),
        "blockSize",
    )
    hash_key: bytes = _setting(
        lambda: os.urandom(16),
        "16-byte SipHash key (hex in files and flags); set it explicitly so replicas agree, keep it secret "
        "so hashes can't be forged. Never read from a policy.",
        normalize=_hex_key,
        parse=str,
        secret=True,
        kind=bytes,
    )
    location_ttl_s: float = _setting(
        600.0,
        "Seconds a learned (block, backend) location is trusted without being seen again.",
        POSITIVE,
        "locationTTLSeconds",
    )
    capacity_blocks: int = _setting(
        8192,
        "Blocks remembered per backend (LRU) until the backend reports its KV size; in a policy, a number "
        'or "auto" (capacity_auto).',
        Bounds(minimum=1),
        "capacityBlocks",
        policy_value=_blocks_or_auto,
        schema="blocks_or_auto",
    )
    index_memory_mib: float = _setting(
        1024.0,
        "Memory the approximate-mode index may use over all backends, in MiB (each location counted "
        "at the most it can take, 72 bytes, where it takes some 50; each backend's table's fixed part; "
        "the chain heads' map as measured); past it the coldest "
        "locations fleet-wide are dropped (kvroute_index_shed_total). Per process, not in a policy: "
        "it is the process's own budget.",
        POSITIVE,
    )
    session_ttl_s: float = _setting(
        3600.0, "Seconds a session binding lives after its last use.", POSITIVE, "sessionTTLSeconds"
    )
    session_capacity: int = _setting(
        100_000, "Session bindings kept (LRU beyond this).", Bounds(minimum=1), "sessionCapacity"
    )
    active_request_cost: float = _setting(
        4.0, "Load of one in-flight request, in blocks of prefill it is worth.", NON_NEGATIVE, "activeRequestCost"
    )
    adapter_load_cost: float = _setting(
        4.0,
        "Cost, in blocks of prefill, of sending a request for a LoRA adapter where it is not running "
        "but a slot is free: the engine swaps it in first.",
        NON_NEGATIVE,
        "adapterLoadCost",
    )
    adapter_evict_cost: float = _setting(
        128.0,
        "Cost, in blocks of prefill, of sending a request for a LoRA adapter where every slot "
        "(--max-loras) holds another running adapter: it waits for one to drain, then evicts it.",
        NON_NEGATIVE,
        "adapterEvictCost",
    )
    adapter_sources: tuple[tuple[str, str], ...] = _setting(
        (),
        "LoRA adapter -> path the servers load it from: kvroute places these adapters itself (vLLM's "
        "/v1/load_lora_adapter, servers started with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), loading one "
        "where none has it, on more servers while its load calls for it, moving one to even the servers' "
        "demand and unloading it where it stays idle; it loads no other name. Empty: placement off. In a "
        "policy a map, as text "
        '"support=/adapters/support,sql=/adapters/sql".',
        policy="adapterSources",
        normalize=_pairs(
            "adapter_sources", _adapter_path, lambda _path: True, "a path of 1-4096 characters", valid_name
        ),
        parse=parse_pairs,
        schema="paths",
    )
    adapter_max_backends: int = _setting(
        1,
        "Servers a placed adapter is kept on while its load does not call for more.",
        Bounds(minimum=1),
        "adapterMaxBackends",
    )
    adapter_scale_out_requests: int = _setting(
        8,
        "Requests in flight per server holding a placed adapter at which it is loaded on one more.",
        Bounds(minimum=1),
        "adapterScaleOutRequests",
    )
    adapter_idle_s: float = _setting(
        120.0,
        "Seconds a placed adapter must go unused on a server (no request in flight or running) before it "
        "is unloaded there; never from the last server holding it.",
        POSITIVE,
        "adapterIdleSeconds",
    )
    adapter_min_resident_s: float = _setting(
        30.0,
        "Seconds a placed adapter stays on a server it was loaded on, and stays off a server it was "
        "unloaded from, before placement changes its mind: the hysteresis that keeps adapters from "
        "thrashing.",
        POSITIVE,
        "adapterMinResidentSeconds",
    )
    balance_abs_gate: float = _setting(
        32.0,
        "A session's backend is overloaded only if its load exceeds the least loaded by this much...",
        NON_NEGATIVE,
        "balanceAbsGate",
    )
    balance_rel_gate: float = _setting(
        1.5, "...and is more than this multiple of the least loaded backend's load.", POSITIVE, "balanceRelGate"
    )
    session_moves: str = _setting(
        "saturated",
        "When load moves a conversation off its backend. saturated: once that backend is past both balance "
        "gates and saturated as flow control judges it (saturationWaitingRequests, saturationKVUsage, "
        "maxBackendRequests, saturationPrefillTokens): an engine with room starts the turn at once, and a move "
        "recomputes the conversation's context and copies it into a second cache. gates: once past the gates "
        "(before 2026-12-06). never: load never moves it (sglang-router's cache_aware at a fleet's usual "
        "imbalance); a backend at maxBackendRequests, or without KV room for the prompt, still does.",
        policy="sessionMoves",
        choices=("gates", "saturated", "never"),
    )
    prefix_stick_ratio: float = _setting(
        0.5,
        "A request stays on a backend holding this share of its prompt unless past the balance gates.",
        POSITIVE,
        "prefixStickRatio",
    )
    eviction_cost_weight: float = _setting(
        3.0,
        "Extra cost per novel block times the backend's recent cache turnover: new prompts evict least there.",
        NON_NEGATIVE,
        "evictionCostWeight",
    )
    churn_half_life_s: float = _setting(
        60.0, "Half-life of the recent-turnover count behind eviction_cost_weight.", POSITIVE, "churnHalfLifeSeconds"
    )
    session_headers: tuple[str, ...] = _setting(
        SESSION_HEADERS,
        "Request headers naming a conversation, tried in order before the body's session ids.",
        policy="sessionHeaders",
        normalize=_header_names,
        schema="headers",
    )
    tenant_header: str = _setting(
        "",
        "Request header naming the tenant (set by the gateway, not the client); session ids are scoped by it. "
        "Empty: one tenant.",
        policy="tenantHeader",
        normalize=_tenant_header,
        schema="header",
    )
    decision_headers: bool = _setting(
        False,
        "Add x-kvroute-decision/-backend/-prefix/-cached-tokens (and -ttft-ms where a TTFT was predicted) to "
        "successful responses. They tell a client whether other clients' prompts are cached and name pod "
        "addresses: enable only where clients are trusted.",
        policy="decisionHeaders",
    )
    index_mode: str = _setting(
        "approximate",
        "approximate: learn from kvroute's own routing, keyed on the prompt's text. precise: tokenize like the "
        "engine and follow its KV cache events (needs tokenizer_path and --kv-events-config on the engines).",
        policy="index",
        choices=("approximate", "precise"),
    )
    tokenizer_path: str = _setting(
        "",
        "Precise mode: a directory with the served model's tokenizer.json and tokenizer_config.json (chat "
        "template); nothing is downloaded. If it cannot be loaded, routing stays approximate and says why.",
        policy="tokenizerPath",
        schema="path",
    )
    capacity_auto: bool = _setting(
        True, "Size each backend's capacity from its vllm:cache_config_info (capacity_blocks until known)."
    )
    prediction_trust: bool = _setting(
        True,
        "Approximate mode: weigh the prefix kvroute sees cached on a backend by the share of its predictions "
        "that the engine's own prefix-cache counters confirm (vllm:prefix_cache_hits_total), at most 1.",
        policy="predictionTrust",
    )
    session_follows_context: bool = _setting(
        True,
        "A conversation whose backend no longer shows prefixStickRatio of its prompt goes to a backend that "
        "shows that much (within the balance gates) instead of computing it again where it was.",
        policy="sessionFollowsContext",
    )
    release_evicted_sessions: bool = _setting(
        False,
        "Where a conversation's prompt continues its last one, whose context its backend has evicted since "
        "(under prefixStickRatio of it shown there), and no backend holds it, the cost decides where it goes, "
        "as for a prompt no cache holds, so conversations packed on a backend too small for them all do not "
        "keep evicting each other there. A conversation whose prompts do not extend each other stays bound. "
        "Off by default: with kvRoomEverywhere, which keeps such conversations from queueing on one engine, "
        "it lowered the hit rate on vLLM-CPU (docs/benchmarks.md).",
        policy="releaseEvictedSessions",
    )
    cache_pressure_gates: bool = _setting(
        True,
        "Widen the balance gates that let a session or a prompt head leave its backend as returning "
        "conversations find their previous prompt evicted (kvroute_cache_pressure), up to 16 times: a "
        "starved fleet then stops copying contexts into every cache. Off: the configured gates always.",
        policy="cachePressureGates",
    )
    new_session_load_weight: float = _setting(
        2.0,
        "Load multiplier when placing a bootstrap request: it decides where a whole conversation will live.",
        NON_NEGATIVE,
        "newSessionLoadWeight",
    )
    shortlist_above: int = _setting(
        32,
        "Above this many candidates a decision weighs only the backends holding the prompt's first "
        "block, the session's and the head's home backend and 16 others (a window moving round the "
        "fleet), so its cost stops growing with the fleet (extproc/core/shortlist.py); 0: always "
        "every candidate.",
        NON_NEGATIVE,
        "shortlistAbove",
    )
    max_backend_requests: int = _setting(
        0,
        "In-flight requests per backend (kvroute's own, other replicas', or the engine's running + "
        "waiting) at which it takes no more: when every candidate has reached it, a request is held "
        "(flow_control) or, with flow control off, answered 429 at once; 0: no limit.",
        NON_NEGATIVE,
        "maxBackendRequests",
    )

    flow_control: bool = _setting(
        True,
        "Hold a request while every candidate is saturated (saturation_waiting, saturation_kv_usage, "
        "max_backend_requests) and dispatch held ones by priority, fair share between flows and deadline "
        "as backends free up, instead of queueing them inside an engine. Off: sent at once, or shed at "
        "max_backend_requests.",
        policy="flowControl",
    )
    saturation_waiting: int = _setting(
        5,
        "Requests waiting at a backend's engine (in flight beyond what it ran at its last sample) at which "
        "it is saturated.",
        Bounds(minimum=1),
        "saturationWaitingRequests",
    )
    saturation_kv_usage: float = _setting(
        0.8,
        "Share of a backend's KV cache that running requests pin (vllm:kv_cache_usage_perc) at which it is saturated.",
        Bounds(minimum=0, exclusive_minimum=True, maximum=1),
        "saturationKVUsage",
    )
    saturation_prefill_tokens: int = _setting(
        0,
        "Prompt tokens a backend still has to prefill for the requests sent to it (every replica's, as "
        "kvroute tracks them until the engine reports them stored) at which it is saturated. A low value "
        "keeps each engine's prefill backlog short, so a request of another flow or a higher priority "
        "held meanwhile starts soon after it is dispatched; 0: not a signal.",
        NON_NEGATIVE,
        "saturationPrefillTokens",
    )
    slo_admission: bool = _setting(
        True,
        "Send a request with a TTFT objective (x-llm-d-slo-ttft-ms) only where its first token is predicted "
        "in time, and refuse a sheddable one (429) where it is predicted nowhere.",
        policy="sloAdmission",
    )
    pd_threshold_tokens: int = _setting(
        1024,
        "Uncached prompt tokens, where a request would be decoded, at or above which it is split in a "
        "disaggregated fleet: prefilled on a prefill backend (role prefill), its KV blocks handed over by "
        "vLLM's kv_transfer_params, decoded on a decode backend; 0: never split. Fleets without prefill "
        "backends are never split.",
        NON_NEGATIVE,
        "disaggregationThresholdTokens",
    )
    pd_flexible: bool = _setting(
        False,
        "Every server runs a KV connector in both roles (vLLM's kv_role kv_both): a backend of role both "
        "may also prefill for another, so the fleet serves whole requests while splitting does not pay "
        "and splits those whose prefill costs less elsewhere than where they decode (strictly less: "
        "a hand-off between equals gains nothing). Off: only fleets with prefill backends are split.",
        policy="flexibleDisaggregation",
    )
    pd_prefill_timeout_s: float = _setting(
        30.0,
        "Seconds a split request's prefill leg may take (the prefill server's queue included) before it "
        "is given up and the request is served whole on its decode backend; a gateway's ext_proc message "
        "timeout must be longer than this plus queueTTLSeconds.",
        POSITIVE,
        "prefillTimeoutSeconds",
    )
    kv_room_cost: float = _setting(
        1.0,
        "Cost, in blocks of prefill, of each block of a request's prompt that does not fit in what the "
        "requests in flight leave free of the engine's KV cache (see kvRoomEverywhere): there it waits for "
        "them to finish, or preempts one. So a long prompt or decode goes where its context fits. 0: KV room "
        "is not weighed.",
        NON_NEGATIVE,
        "kvRoomCost",
    )
    kv_room_everywhere: bool = _setting(
        True,
        "Weigh KV room (kvRoomCost) in every fleet, not only in fleets that split requests: a prompt that "
        "does not fit beside the requests in flight on an engine (kvroute's own, waiting ones too, or the "
        "running ones its last sample shows) waits there, and what it has cached there may be evicted while "
        "it waits. false: only in fleets that split requests.",
        policy="kvRoomEverywhere",
    )
    in_flight_heads: bool = _setting(
        True,
        "Approximate mode: the prompt a request in flight carries counts as held on its backend before the "
        "picture learns it (at its response's start; over ext_authz at its end), so a later request with the "
        "same head matches it there, reserves only what is new, and makes the picture evict room only for "
        "that. false: a prompt is held only once learned.",
        policy="inFlightHeads",
    )
    queue_max_requests: int = _setting(
        1024,
        "Requests flow control holds at most, in all priority bands together; when full, the newest "
        "sheddable request (priority below 0) below the newcomer's priority makes room, else the newest of "
        "the flow holding most in the newcomer's band while it would still hold more than the newcomer's "
        "flow, else the newcomer gets 429.",
        Bounds(minimum=1),
        "queueMaxRequests",
    )
    queue_max_bytes: int = _setting(
        256 << 20, "Request body bytes held at most per priority band.", Bounds(minimum=1), "queueMaxBytes"
    )
    queue_ttl_s: float = _setting(
        30.0,
        "Seconds a request is held at most before it is answered 429; a gateway's ext_proc message timeout "
        "must be longer.",
        POSITIVE,
        "queueTTLSeconds",
    )
    queue_metric_flows: tuple[str, ...] = _setting(
        (),
        "Flow ids (fairness ids or tenants) that flow control's metrics name; every other flow is counted as "
        "'other', so clients cannot add series or read other tenants' names on the monitoring port.",
        policy="queueMetricFlows",
        normalize=_flow_names,
        schema="names",
    )
    flow_weights: tuple[tuple[str, float], ...] = _setting(
        (),
        "Flow id -> weight of its fair share while flow control holds requests (others: 1); in a policy "
        'a map, as text "team-a=2,team-b=0.5".',
        policy="flowWeights",
        normalize=_pairs("flow_weights", float, lambda w: 0 < w <= 1e6, "a weight above 0, at most 1e6"),
        parse=parse_pairs,
        schema="weights",
    )
    objective_priorities: tuple[tuple[str, int], ...] = _setting(
        (),
        "Objective name (x-llm-d-inference-objective) -> priority, for fleets without InferenceObjective "
        "resources; an InferenceObjective of the same name wins. Below 0: sheddable.",
        policy="objectivePriorities",
        normalize=_pairs("objective_priorities", _int, lambda p: -(2**31) <= p < 2**31, "an int32"),
        parse=parse_pairs,
        schema="priorities",
    )
    engine_priority: bool = _setting(
        True,
        "Tell each engine its request's priority (x-vllm-priority: minus the objective's, as vLLM serves "
        "lower first), so an engine run with --scheduling-policy priority orders its own waiting queue as "
        "flow control does and, short of KV cache, preempts the lowest first; engines that schedule first "
        "come, first served ignore it. A client's own header never reaches an engine.",
        policy="enginePriority",
    )
    default_output_tokens: int = _setting(
        256,
        "Output tokens a request that sets no max_tokens is expected to generate, in its flow's share.",
        NON_NEGATIVE,
        "defaultOutputTokens",
    )
    queue_max_flows: int = _setting(
        256,
        "Flows (fairness ids) tracked per priority band; requests of further ids share one overflow flow, "
        "so a flood of ids can neither grow memory nor starve known flows.",
        Bounds(minimum=1, maximum=MAX_QUEUE_FLOWS),
        "queueMaxFlows",
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            normalize = f.metadata["normalize"]
            if normalize is not None:
                object.__setattr__(self, f.name, normalize(getattr(self, f.name)))
            value = getattr(self, f.name)
            check_value(f.name, f.metadata["kind"], f.metadata["bounds"], value)
            if f.metadata["choices"] and value not in f.metadata["choices"]:
                raise ValueError(f"{f.name} must be one of {', '.join(f.metadata['choices'])}")
        if not isinstance(self.hash_key, bytes) or len(self.hash_key) != 16:
            raise ValueError("hash_key must be exactly 16 bytes")

    @classmethod
    def help(cls) -> dict[str, str]:
        """Setting name -> one-line description."""
        return {f.name: f.metadata["help"] for f in fields(cls)}

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> Settings:
        """Build from a config mapping; `hash_key` may be hex text. Unknown names are an error."""
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown settings: {sorted(unknown)}")
        return cls(**values)
