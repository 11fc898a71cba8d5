"""matplotlib's pyplot on the file-only backend, imported when a plot is drawn: importing it costs
about half a second, which every `kvroute-dev` command and every test process importing the bench
modules would otherwise pay."""

from __future__ import annotations

from types import ModuleType


def pyplot() -> ModuleType:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
