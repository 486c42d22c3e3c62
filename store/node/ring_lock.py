"""Which process holds each end of a ring: Linux open-file-description (OFD) byte locks.

The producer holds a write lock on byte 0 of the ring file, the consumer one on byte 1, for as
long as they have the ring open. The kernel drops a lock when its holder's file description is
closed, which a SIGKILL does too, so "is the producer alive?" is one ``F_OFD_GETLK`` call: no
pid that may be reused, no start time, and it works across pid namespaces (an engine container
and a node sidecar that share ``/dev/shm`` see different pids for the same process).

OFD locks, unlike POSIX ``lockf`` locks, belong to the open file description, not the process:
a producer and a consumer in one process (tests, a notebook) still exclude each other, and
closing an unrelated descriptor of the file drops nothing. A ``fork``'s child shares the
description and so holds the lock as long as it lives; engines start ring users after forking.
"""
from __future__ import annotations

import errno
import fcntl
import os
import struct
from enum import IntEnum

# struct flock on Linux (x86-64 and aarch64): l_type, l_whence, l_start, l_len, l_pid, padded to 8
_FLOCK = struct.Struct("hhqqi0q")


class RingEnd(IntEnum):
    """The byte of the ring file each end locks."""

    PRODUCER = 0
    CONSUMER = 1


def _flock(kind: int, end: RingEnd) -> bytes:
    return _FLOCK.pack(kind, os.SEEK_SET, int(end), 1, 0)


def try_hold(fd: int, end: RingEnd) -> bool:
    """Take ``end``'s lock on ``fd``'s file description; False when another description holds it."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_WRLCK, end))
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def let_go(fd: int, end: RingEnd) -> None:
    """Release ``end``'s lock held through ``fd`` (closing the file does it too)."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_UNLCK, end))


def is_held(fd: int, end: RingEnd) -> bool:
    """Whether a file description other than ``fd``'s holds ``end``'s lock (its holder lives)."""
    got = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _flock(fcntl.F_WRLCK, end))
    return _FLOCK.unpack(got)[0] != fcntl.F_UNLCK
