"""controller/late_crds.py's guard: it calls kopf internals only on the kopf it was tested with."""

from __future__ import annotations

import asyncio
import importlib.metadata

import kopf

from controller import late_crds


def test_another_kopf_gets_no_rescans(monkeypatch, caplog):
    assert late_crds.supported()  # the pinned kopf
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.9.9")
    follow = late_crds.follow_late_crd(
        late_crds.Insights(), kopf.OperatorSettings(), kopf.OperatorRegistry(), "g", "p", interval_s=0
    )
    asyncio.run(asyncio.wait_for(follow, 5))  # returns at once instead of rescanning forever
    assert "not rescanning for late CRDs" in caplog.text
