"""The scheduler role's part of the fleet's memory: a finished request is recorded on the fleet thread, not on
vLLM's, and past a bound of waiting requests on the caller's (nothing dropped, no file written there).

The role is the real one over a real local tier, no node; the spy wraps the real recorder's ``record`` and
``flush`` to note which thread called them.
"""
from __future__ import annotations

import threading

from store.engines.vllm import memory as memory_module
from tests.store.engines.vllm import scheduler_fakes as fakes


def finish(role, i: int) -> None:  # type: ignore[no-untyped-def]
    """One request as vLLM drives it, up to its end: it arrives, is looked up, allocated, finished."""
    req = fakes.Req(f"r{i}", fakes.tokens(2 * fakes.KB + 3, seed=i))
    role.on_new_request(req)
    n, _ = role.get_num_new_matched_tokens(req, 0)
    role.update_state_after_alloc(req, list(range(1, 2 * fakes.KB // fakes.EB + 2)), n or 0)
    role.request_finished(req)


def spy(role, monkeypatch) -> list[tuple[str, str]]:  # type: ignore[no-untyped-def]
    calls: list[tuple[str, str]] = []
    rec = role.memory.recorder
    for name in ("record", "flush"):
        real = getattr(rec, name)

        def wrapped(*a, _real=real, _name=name, **kw):  # type: ignore[no-untyped-def]
            calls.append((_name, threading.current_thread().name))
            return _real(*a, **kw)

        monkeypatch.setattr(rec, name, wrapped)
    return calls


def test_a_finished_request_is_recorded_on_the_fleet_thread_and_stats_wait_for_it(tmp_path, monkeypatch):
    role = fakes.role(tmp_path)
    calls = spy(role, monkeypatch)
    for i in range(3):
        finish(role, i)
    role.stats()  # waits for the records handed so far
    assert [c for c in calls if c[0] == "record"] == [("record", calls[0][1])] * 3
    assert calls[0][1].startswith("kvwarm-fleet") and calls[0][1] != threading.current_thread().name
    assert role.memory.recorder.stats.as_dict()["requests"] == 3
    role.close()


def test_past_the_bound_a_request_is_recorded_here_and_nothing_is_written_here(tmp_path, monkeypatch):
    monkeypatch.setattr(memory_module, "MAX_QUEUED", 2)
    role = fakes.role(tmp_path)
    calls = spy(role, monkeypatch)
    gate = threading.Event()
    role.memory._writer.submit(gate.wait, 60)  # the fleet thread busy: requests wait for it
    for i in range(5):
        finish(role, i)
    here = threading.current_thread().name
    assert [c for c in calls if c == ("record", here)] == [("record", here)] * 3  # the two past the bound of 2
    gate.set()
    assert role.memory.flush(60)
    assert role.memory.recorder.stats.as_dict()["requests"] == 5  # none dropped
    assert ("flush", here) not in calls  # files are written on the fleet thread only
    role.close()
