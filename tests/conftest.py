"""Shared test set-up: hypothesis without deadlines (this machine is shared and noisy)."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile("default", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile("ci", parent=settings.get_profile("default"), max_examples=200)
settings.load_profile("ci" if os.environ.get("CI") else "default")
