"""The bench's tests run fastddp and the product suite's multi-rank harness
(tests/_dist.py), so they take the product suite's isolation fixture and
its session hooks: the native modules built before the first test, what the
session collected frozen out of the collector's sight, and the multi-rank
workers the session shared stopped at its end.  Its own pytest session
(``python -m pytest bench/tests``), as tools/tests: tests/conftest.py's
options (``--fast``, ``--record-durations``) are not defined here."""

from __future__ import annotations

from tests.conftest import (_isolate, pytest_collection_finish, pytest_sessionfinish,  # noqa: F401
                            pytest_sessionstart)  # the fixture and the session hooks
