"""Background threads yield the CPU to the engine's forward.

kvwarm's serving threads (the write-back's encoder and uploads, the node agent's copies)
do CPU work beside the model: FP8 encoding, checksums, the S3 client. On a node whose cores
also run the forward (vLLM on the CPU, or a GPU host with few cores), that work would take
the cores the forward needs when both want them. :func:`lower_this_thread` gives the calling
thread (and the threads it starts from then on, torch's OpenMP team included) a lower
scheduling priority (a higher nice value), so the forward is served first and the
background work runs in what is left. ``KVWARM_BACKGROUND_NICE`` sets the increment (default
10; 0 leaves priorities alone).
"""
from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("kvwarm.loader")
NICE_ENV = "KVWARM_BACKGROUND_NICE"
DEFAULT_NICE = 10


def background_nice() -> int:
    """The nice increment of kvwarm's background threads (``$KVWARM_BACKGROUND_NICE``, default 10)."""
    raw = os.environ.get(NICE_ENV, "").strip()
    if not raw:
        return DEFAULT_NICE
    try:
        value = int(raw)
    except ValueError:
        log.warning("%s=%r is not an integer: background threads keep the default nice %d", NICE_ENV, raw,
                    DEFAULT_NICE)
        return DEFAULT_NICE
    return max(0, min(19, value))


def lower_this_thread() -> int | None:
    """Give the calling thread the process's nice value plus :func:`background_nice` (Linux: per
    thread; the process's is its main thread's). Calling it again changes nothing: a thread
    shared by several users (s3fs's event loop) is lowered once.

    Returns the thread's nice value then, or ``None`` where that cannot be done (another OS,
    or a sandbox that refuses it): the thread then runs at the process's priority, as before.
    """
    step = background_nice()
    if step == 0 or not hasattr(os, "setpriority"):
        return None
    try:
        tid = threading.get_native_id()
        target = min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + step)
        if os.getpriority(os.PRIO_PROCESS, tid) < target:
            os.setpriority(os.PRIO_PROCESS, tid, target)
        return os.getpriority(os.PRIO_PROCESS, tid)
    except (OSError, AttributeError) as exc:
        log.debug("background thread priority unchanged: %s", exc)
        return None
