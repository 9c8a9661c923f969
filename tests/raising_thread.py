"""A call expected to raise, run in a thread, and checked from the test's own thread.

``pytest.raises`` as a thread's target cannot fail a test: the ``Failed`` it raises when
nothing is raised ends in the thread's excepthook, which pytest reports as a warning, and
the test passes. :class:`RaisingThread` keeps what the call raised (or that it returned)
and :meth:`RaisingThread.check` asserts it in the test."""

from __future__ import annotations

import re
import threading
from typing import Any, Callable


class RaisingThread(threading.Thread):
    def __init__(self, expected: type[BaseException], fn: Callable[..., Any], *args: Any,
                 match: str | None = None, **kwargs: Any) -> None:
        super().__init__(daemon=True)
        self.expected, self.match = expected, match
        self._call = lambda: fn(*args, **kwargs)
        self.error: BaseException | None = None
        self.returned = False

    def run(self) -> None:
        try:
            self._call()
            self.returned = True
        except BaseException as e:  # noqa: BLE001 - kept for check()
            self.error = e

    def check(self, timeout_s: float) -> BaseException:
        """Waits up to ``timeout_s`` for the call to end; asserts it raised ``expected`` (matching)."""
        self.join(timeout_s)
        assert not self.is_alive(), f"the call expected to raise {self.expected.__name__} still runs after {timeout_s}s"
        assert not self.returned, f"the call returned instead of raising {self.expected.__name__}"
        assert isinstance(self.error, self.expected), f"expected {self.expected.__name__}, got {self.error!r}"
        if self.match is not None:
            assert re.search(self.match, str(self.error)), f"{self.error!s} does not match {self.match!r}"
        return self.error
