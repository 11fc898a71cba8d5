"""`python -m tools.settings_doc > docs/settings.md`: the settings reference, rendered from the
declarations (extproc/core/settings.py, extproc/runtime/config.py); tests/test_settings.py fails
if the committed file differs."""

from __future__ import annotations

import sys
from dataclasses import MISSING, fields

from extproc.core.settings import MAX_SETTING, Bounds, Settings
from extproc.runtime.config import DEFAULTS, PROCESS_HELP, default_text


def bounds_text(bounds: Bounds | None) -> str:
    if bounds is None:
        return ""
    parts = []
    if bounds.minimum is not None:
        parts.append(f"{'>' if bounds.exclusive_minimum else '>='} {bounds.minimum}")
    if bounds.maximum != MAX_SETTING:  # (every number is at most that: said once, above the table)
        parts.append(f"<= {bounds.maximum}")
    if bounds.multiple_of is not None:
        parts.append(f"multiple of {bounds.multiple_of}")
    return ", ".join(parts)


def settings_reference() -> str:
    """docs/settings.md, rendered from the declarations (a test fails if the file differs)."""
    lines = [
        "# Settings reference",
        "",
        "Generated from `extproc/core/settings.py` and `extproc/runtime/config.py` by",
        "`python -m tools.settings_doc > docs/settings.md`; tests/test_settings.py fails if it is stale.",
        "",
        "Layers, lowest first: defaults, a YAML file (`--config` or `KVROUTE_CONFIG`), `KVROUTE_*`",
        "environment, flags. A KVRoutingPolicy's `spec.routing` is laid over the routing settings live.",
        "",
        "## Process",
        "",
        "| key (YAML) | environment | flag | default | what |",
        "|---|---|---|---|---|",
    ]
    for name, text in PROCESS_HELP.items():
        if name == "policies":  # a structured list: the file only
            lines.append(f"| `{name}` | - | - | none | {text} |")
            continue
        flag = "--backend" if name == "backends" else "--" + name.replace("_", "-")
        default = "none" if name == "backends" else default_text(DEFAULTS[name])
        lines.append(f"| `{name}` | `KVROUTE_{name.upper()}` | `{flag}` | {default} | {text} |")
    lines += [
        "",
        "## Routing (`routing:` in YAML)",
        "",
        f"Every number is at most {MAX_SETTING:,} unless its bounds say less.",
        "",
        "| setting | environment / flag | policy `spec.routing` | default | bounds | what |",
        "|---|---|---|---|---|---|",
    ]
    for f in fields(Settings):
        default = "random per process" if f.default is MISSING else default_text(f.default)
        policy = f"`{f.metadata['policy']}`" if f.metadata["policy"] else "not in policies"
        env_flag = f"`KVROUTE_{f.name.upper()}` / `--{f.name.replace('_', '-')}`"
        row = f"| `{f.name}` | {env_flag} | {policy} | {default} | {bounds_text(f.metadata['bounds'])} |"
        lines.append(f"{row} {f.metadata['help']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(settings_reference())
