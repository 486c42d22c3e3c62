"""A directory the store takes for a remote tier (S3), for the write-back and upload tests.

Its writes can be held (to keep uploads in flight together: a slow S3), made to fail as an
unreachable S3 does (``down``) or as a refusing one does (``refuse``), and are logged in the
order they were asked for.
"""
from __future__ import annotations

import threading

from store.errors import StoreError, StoreUnavailable
from store.tiers.local import LocalTier
from tests.hang_guard import HANG_S


class FarDir(LocalTier):
    """A remote tier in a local directory. Its writes count how many are in flight at once and
    wait while ``held`` is clear (the wait's bound is a hang guard); with ``down`` they fail as
    an unreachable S3 does, with ``refuse`` as one that refuses the object. ``asked`` lists the
    names written, in the order their writes began."""

    remote = True
    kind = "s3"

    def __init__(self, root) -> None:
        super().__init__(root, cap_bytes=1 << 30)
        self.held = threading.Event()
        self.held.set()
        self.down = False
        self.refuse = False
        self.inflight = self.most = self.attempts = 0
        self.asked: list[str] = []
        self._lock = threading.Lock()

    def write(self, name, data, *, expires_at):
        with self._lock:
            self.attempts += 1
            self.inflight += 1
            self.most = max(self.most, self.inflight)
            self.asked.append(name)
        try:
            if not self.held.wait(HANG_S):
                raise AssertionError("the test never released the held uploads")
            if self.down:
                raise StoreUnavailable(f"{self.kind} is unreachable (the test took it down)")
            if self.refuse:
                raise StoreError(f"{self.kind} refused {name} (the test told it to)")
            return super().write(name, data, expires_at=expires_at)
        finally:
            with self._lock:
                self.inflight -= 1
