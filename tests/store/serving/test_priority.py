"""Background threads' priority (store/serving/priority.py): lowered per thread, never the caller's."""
from __future__ import annotations

import logging
import os
import threading

import pytest

from store.serving import priority


def in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append((fn(), os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))))
    t.start()
    t.join()
    return out[0]


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread priorities on this OS")
def test_a_background_thread_is_lowered_and_the_rest_of_the_process_is_not(monkeypatch):
    monkeypatch.delenv(priority.NICE_ENV, raising=False)
    main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    got, seen = in_thread(priority.lower_this_thread)
    if got is None:
        pytest.skip("this sandbox refuses setpriority")
    assert got == seen == min(19, main + priority.DEFAULT_NICE)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main
    # a thread it starts inherits it (torch's OpenMP team of the write-back encoder)
    def child():
        priority.lower_this_thread()
        return in_thread(lambda: None)[1]
    assert in_thread(child)[0] == min(19, main + priority.DEFAULT_NICE)
    # lowered twice (a thread several users share), it is lowered once
    assert in_thread(lambda: (priority.lower_this_thread(), priority.lower_this_thread())[1])[0] == \
        min(19, main + priority.DEFAULT_NICE)


def test_the_increment_is_set_by_the_environment(monkeypatch, caplog):
    monkeypatch.setenv(priority.NICE_ENV, "0")
    assert priority.background_nice() == 0 and in_thread(priority.lower_this_thread)[0] is None
    monkeypatch.setenv(priority.NICE_ENV, "40")
    assert priority.background_nice() == 19
    monkeypatch.setenv(priority.NICE_ENV, "low")
    with caplog.at_level(logging.WARNING, logger="kvwarm.loader"):
        assert priority.background_nice() == priority.DEFAULT_NICE
    assert "KVWARM_BACKGROUND_NICE='low' is not an integer" in caplog.text
