"""Sibling ext_proc replicas sharing one picture of the fleet."""
