"""Experiments, sweeps and the link tooling: run from a clone (``python -m tools.<name>``), never installed."""
