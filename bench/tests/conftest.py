"""The bench's tests run fastddp and the product suite's multi-rank harness
(tests/_dist.py), so they take the product suite's isolation fixture and the
two session hooks that concern them: the native modules built before the
first test, and the multi-rank workers the session shared stopped at its
end.  Its own pytest session (``python -m pytest bench/tests``), as
tools/tests: tests/conftest.py's options (``--fast``) are not defined here."""

from __future__ import annotations

from tests.conftest import _isolate, pytest_sessionstart  # noqa: F401  (autouse fixture, session hook)


def pytest_sessionfinish(session, exitstatus):
    from tests._dist import close_shared_worlds

    close_shared_worlds()
