"""A renderer for the subset of Helm's Go templates that charts/kvroute uses, for tests only.

No Helm binary can be installed on this project's machines (no Helm on PyPI or Debian), so the
chart is rendered here with exactly the constructs it uses: `.Values/.Release/.Chart` paths,
`if`/`else`/`end`, `define`/`include`, and the functions `toYaml`, `nindent`, `indent`, `quote`,
with `{{-`/`-}}` whitespace trimming. Anything else raises, so the chart cannot silently grow a
construct these tests do not understand.
"""

from __future__ import annotations

import re
import shlex
import textwrap
from pathlib import Path
from typing import Any

import yaml

_ACTION = re.compile(r"{{(-?)\s*(.*?)\s*(-?)}}", re.S)


def _tokens(text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    trim_next = False
    for match in _ACTION.finditer(text):
        chunk = text[pos : match.start()]
        if trim_next:
            chunk = chunk.lstrip()
        if match.group(1):
            chunk = chunk.rstrip()
        out.append(("text", chunk))
        out.append(("action", match.group(2)))
        trim_next = bool(match.group(3))
        pos = match.end()
    tail = text[pos:]
    out.append(("text", tail.lstrip() if trim_next else tail))
    return out


def _parse(tokens: list[tuple[str, str]], defines: dict[str, list]) -> list:
    """Nested nodes: ("text", s), ("expr", e), ("if", cond, then, else)."""
    root: list = []
    stack: list[tuple[str, Any, list]] = [("root", None, root)]
    for kind, value in tokens:
        body = stack[-1][2]
        if kind == "text":
            body.append(("text", value))
        elif value.startswith("if "):
            node = ["if", value[3:], [], []]
            body.append(node)
            stack.append(("if", node, node[2]))
        elif value == "else":
            _, node, _ = stack.pop()
            stack.append(("else", node, node[3]))
        elif value.startswith("define "):
            name = shlex.split(value)[1]
            defines[name] = []
            stack.append(("define", name, defines[name]))
        elif value == "end":
            stack.pop()
        elif value.startswith(("range ", "with ", "template ", "/*")):
            raise NotImplementedError(f"unsupported action: {value}")
        else:
            body.append(("expr", value))
    if len(stack) != 1:
        raise ValueError("unbalanced template")
    return root


class Chart:
    """Loads a chart's templates and renders them for given values."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.meta = yaml.safe_load((path / "Chart.yaml").read_text())
        self.defaults = yaml.safe_load((path / "values.yaml").read_text())
        self.defines: dict[str, list] = {}
        self.templates: dict[str, list] = {}
        for file in sorted((path / "templates").iterdir()):
            tree = _parse(_tokens(file.read_text()), self.defines)
            if not file.name.startswith("_"):
                self.templates[file.name] = tree

    def render(
        self, values: dict[str, Any] | None = None, release: str = "kvroute", namespace: str = "kvroute"
    ) -> dict[str, str]:
        context = {
            "Values": _merge(self.defaults, values or {}),
            "Release": {"Name": release, "Namespace": namespace},
            "Chart": {
                "Name": self.meta["name"],
                "Version": self.meta["version"],
                "AppVersion": self.meta["appVersion"],
            },
        }
        return {name: self._run(tree, context) for name, tree in self.templates.items()}

    def documents(self, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        docs = []
        for text in self.render(values).values():
            docs += [d for d in yaml.safe_load_all(text) if d]
        docs += [d for f in sorted((self.path / "crds").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
        return docs

    def _run(self, nodes: list, context: dict[str, Any]) -> str:
        out = []
        for node in nodes:
            if node[0] == "text":
                out.append(node[1])
            elif node[0] == "expr":
                out.append(_show(self._pipeline(node[1], context)))
            else:
                _, cond, then, otherwise = node
                out.append(self._run(then if _truthy(self._pipeline(cond, context)) else otherwise, context))
        return "".join(out)

    def _pipeline(self, expr: str, context: dict[str, Any]) -> Any:
        value: Any = None
        for i, command in enumerate(part.strip() for part in expr.split("|")):
            words = shlex.split(command)
            args = [self._arg(w, context) for w in words[1:]]
            if i:
                args.append(value)
            value = (
                self._call(words[0], args, context) if not words[0].startswith(".") else self._arg(words[0], context)
            )
        return value

    def _arg(self, word: str, context: dict[str, Any]) -> Any:
        if word == ".":
            return context
        if word.startswith("."):
            value: Any = context
            for key in word[1:].split("."):
                value = value.get(key) if isinstance(value, dict) else None
            return value
        if word.isdigit():
            return int(word)
        return word

    def _call(self, name: str, args: list[Any], context: dict[str, Any]) -> Any:
        if name == "include":
            return self._run(self.defines[args[0]], args[1])
        if name == "toYaml":
            return yaml.safe_dump(args[0], sort_keys=True, default_flow_style=False).rstrip("\n")
        if name == "nindent":
            return "\n" + textwrap.indent(str(args[1]), " " * args[0])
        if name == "indent":
            return textwrap.indent(str(args[1]), " " * args[0])
        if name == "quote":
            return '"' + str(args[0]).replace('"', '\\"') + '"'
        raise NotImplementedError(f"unsupported function: {name}")


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        out[key] = _merge(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


def _truthy(value: Any) -> bool:
    return bool(value)


def _show(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
