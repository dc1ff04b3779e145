"""The bench's tests run fastddp and the product suite's multi-rank harness
(tests/_dist.py), so they take the product suite's isolation fixture and the
session hooks that concern them: the native modules built before the
first test, what the session collected frozen out of the collector's sight,
and the multi-rank workers the session shared stopped at its end.  Its own pytest session (``python -m pytest bench/tests``), as
tools/tests: tests/conftest.py's options (``--fast``) are not defined here."""

from __future__ import annotations

import gc

from tests.conftest import _isolate, pytest_collection_finish, pytest_sessionstart  # noqa: F401  (fixture, hooks)


def pytest_sessionfinish(session, exitstatus):
    from tests._dist import close_shared_worlds

    close_shared_worlds()
    gc.unfreeze()
