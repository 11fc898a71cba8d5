"""Generated from protos/ by `python protos/generate.py`; do not edit."""
