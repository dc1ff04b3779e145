"""Tests of the bench (``fastddp.bench``; not the product suite): ``python -m pytest bench/tests``."""
