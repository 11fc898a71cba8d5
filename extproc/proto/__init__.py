"""Generated from protos/ by `python -m extproc.protogen`; do not edit."""
