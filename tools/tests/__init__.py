"""Tests of tools/ (not the product suite: ``python -m pytest tools/tests``)."""
