"""What the scheduler role remembers about each request, from its arrival to its end.

vLLM asks about a waiting request at every step it waits, so the probe's answer is kept here,
and so is everything the later calls need: the tenant, vLLM's hit, what was answered, the
request's engine blocks, how far its prompt is saved, how its load went. A request's state is
dropped when vLLM finishes it: memory follows the requests in flight. Pure: no vLLM.
"""
from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from store.engines.vllm.fetches import Pending
from store.engines.vllm.probe import ProbeHit


@dataclass
class RequestState:
    """One request, as the scheduler role knows it.

    Attributes:
        req_id: vLLM's request id.
        prompt: its prompt token ids.
        tenant: its tenant, or ``None`` when kvwarm serves it nothing (``refusal`` says why).
        refusal: ``unsupported``, or a tenancy reason (``tenant_unknown``...: the server's, never the client's).
        hit: the probe's answer, kept while the request waits.
        pending: an S3 copy the request waits for.
        fetch_reason: why the hit is shorter than it could be (``fetch_scheduled``, ``fetch_timeout``...).
        asked: whether vLLM asked about it (a lookup to resolve).
        counted: whether its lookup was resolved and counted (once per request: a hit or a miss).
        matched_counted: whether its allocated tokens were counted (once: a reload after preemption is not).
        computed: vLLM's own hit at the last ask.
        answer: the tokens answered at the last ask.
        block_table: its engine blocks, in token order.
        save_from: kvwarm blocks below this one are stored, or planned for write-back ...
        save_chat: ... in the tenant's chat-keyed chain (else its plain one).
        save_wait: a save was refused (its KV was computed over a failed load): plan the next one
            only in a step that computes prompt tokens (the engine recomputing it).
        in_flight: tokens of loads sent to the worker and not yet reported.
        loaded: tokens the worker reported loaded.
        planned: tokens of every load planned.
        reason: why it loaded nothing, or less than planned (the last such reason), as the client is told.
        load_failed: a load of it got less than planned: it is not loaded again (answered 0), since the
            same chain may fail the same way (evicted, expired, corrupt), and vLLM asks again about a
            request whose async load got nothing.
    """

    req_id: str
    prompt: tuple[int, ...]
    tenant: str | None
    refusal: str | None = None
    hit: ProbeHit | None = None
    pending: Pending | None = None
    fetch_reason: str | None = None
    asked: bool = False
    counted: bool = False
    matched_counted: bool = False
    computed: int = 0
    answer: int = 0
    block_table: list[int] = field(default_factory=list)
    save_from: int = 0
    save_chat: bool = False
    save_wait: bool = False
    in_flight: int = 0
    loaded: int = 0
    planned: int = 0
    reason: str | None = None
    load_failed: bool = False

    def outcome(self) -> dict[str, object]:
        """What kvwarm did for the request (returned to the client in ``kv_transfer_params``).

        Only what the request's own lookup gave: tokens loaded and the client's reason. No tenant:
        whose it was is the server's to log, and any answer would tell a client whether a
        name or salt it tried is configured. A load still unreported when vLLM finishes the
        request worked: vLLM reschedules a request whose load failed instead of finishing it in
        that step.
        """
        return {"loaded_tokens": self.loaded + self.in_flight, "reason": self.reason}


class Tracker:
    """The requests the scheduler role knows, by id (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._states: dict[str, RequestState] = {}

    def get(self, req_id: str) -> RequestState | None:
        with self._lock:
            return self._states.get(req_id)

    def get_many(self, req_ids: Iterable[str]) -> list[RequestState | None]:
        """:meth:`get` of each of ``req_ids``, under one hold of the lock (the scheduler's every step)."""
        with self._lock:
            return list(map(self._states.get, req_ids))

    def add(self, state: RequestState) -> RequestState:
        """Keep ``state`` (a request already known keeps its first state)."""
        with self._lock:
            return self._states.setdefault(state.req_id, state)

    def drop(self, req_id: str) -> RequestState | None:
        with self._lock:
            return self._states.pop(req_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._states)
