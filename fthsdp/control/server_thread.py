"""An asyncio gRPC server of ours on its own event loop, in a daemon thread.

The lighthouse and the relay are asyncio servers (``await start()``,
``await stop()``, ``address``). Tests, notebooks and the Ray launcher's actors
run them inside a process that has its own main thread to keep; this is the one
place that owns the thread, the loop and the hand-over of start-up errors.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable


class ServerThread:
    """``with ServerThread(make, name) as t: t.address``: ``make()`` builds the server inside the
    thread's loop; the address is valid once the context is entered; leaving it stops the server.
    A server that fails to start raises its error from :meth:`start`."""

    def __init__(self, make: Callable[[], Any], name: str, start_timeout_s: float = 10.0) -> None:
        self._make = make
        self._name = name
        self._start_timeout_s = start_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.server: Any = None

    @property
    def address(self) -> str:
        assert self.server is not None, f"{self._name} not started"
        return self.server.address

    def start(self) -> str:
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()
        if not self._ready.wait(self._start_timeout_s):
            raise TimeoutError(f"{self._name} did not start within {self._start_timeout_s}s")
        if self._error is not None:
            raise self._error
        return self.address

    def _run(self) -> None:
        async def main() -> None:
            self._stop = asyncio.Event()
            self.server = self._make()
            try:
                await self.server.start()
            except BaseException as e:
                self._error = e
                self._ready.set()
                return
            self._ready.set()
            await self._stop.wait()
            await self.server.stop()

        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(main())
        finally:
            self._loop.close()

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._thread is None:
            return
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:
                pass  # loop already finished
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"{self._name} thread did not stop within {timeout_s}s")
        self._thread = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
