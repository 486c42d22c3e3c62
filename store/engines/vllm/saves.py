"""Write-back planning in the scheduler role: where a request's computed blocks go, and which to save each step.

A request's blocks extend the chain its hit is in (plain or chat-keyed), after the hit; after a
hit in ``public`` (or none), the tenant's own plain chain from block 0, once the prompt goes
past the public blocks (a chain is found only from its root). Each step, the full prompt
blocks computed since the last save are planned (:func:`store.engines.vllm.planning.save_spec`).
A save the worker refused (its KV was computed over a failed load,
:mod:`store.engines.vllm.validity`, or its tail did not fit in the write-back queue) moves the
request back to the refused block, and nothing more is planned for it until a step computes
prompt tokens again (the engine recomputing them, or the next chunk of a long prompt: its save
then starts at the refused block, so blocks are stored in prefix order).

A request decoding past a prompt that needs no more saves (saved, refused, or not kvwarm's to
save) needs nothing each step; the planner remembers those (:meth:`SavePlanner.decoding`), so that
a step of hundreds of steady decodes looks at none of them one by one.
Pure: request states and numbers, no vLLM.
"""
from __future__ import annotations

import sys
from itertools import compress, repeat
from operator import itemgetter, lt

from store.engines.vllm.decodes import Decodes
from store.engines.vllm.metadata import SaveSpec
from store.engines.vllm.planning import prompt_tokens_scheduled, save_spec
from store.engines.vllm.tracker import RequestState, Tracker
from store.identity.tenant import PUBLIC


class SavePlanner:
    """Which blocks of each request the worker copies out for write-back.

    Args:
        write_back: whether write-back is on at all.
        kv_block: kvwarm's block size; ``engine_block``: vLLM's (which divides it).
    """

    def __init__(self, *, write_back: bool, kv_block: int, engine_block: int) -> None:
        self.write_back = write_back
        self.kv_block = kv_block
        self.engine_block = engine_block
        self.ratio = kv_block // engine_block
        # request -> its prompt's length, for the requests that plan nothing while they decode past it
        # (:meth:`_done`); forgotten whenever their saves change other than by :meth:`step`
        self._quiet: dict[str, int] = {}

    def where(self, st: RequestState) -> None:
        """Set where the request's write-back goes, from its hit (``save_from``, ``save_chat``)."""
        self._quiet.pop(st.req_id, None)
        hit = st.hit
        if hit is not None and hit.blocks and hit.namespace == st.tenant:
            st.save_from, st.save_chat = hit.blocks, hit.chat
        else:
            st.save_from, st.save_chat = 0, False

    def _done(self, st: RequestState) -> bool:
        """Whether a step decoding past the request's prompt plans nothing (and changes nothing): its prompt
        is saved, its save was refused (planned again only with prompt tokens), or it is not kvwarm's to save."""
        public = st.hit.blocks if st.hit is not None and st.hit.namespace == PUBLIC else 0
        full = len(st.prompt) // self.kv_block
        return st.save_wait or st.save_from >= full or not self.write_back or st.tenant in (None, PUBLIC) \
            or bool(public and full <= public)

    def decoding(self, decodes: Decodes, tracker: Tracker, saves: list[SaveSpec]) -> int:
        """:meth:`step` for each of the step's steady decodes that may plan a save (into ``saves``); returns
        their prompt tokens. Those known to plan nothing are passed over in bulk."""
        ids, starts, tokens = decodes
        quiet = self._quiet
        try:  # each request's prompt length, when it plans nothing past it
            past = itemgetter(*ids)(quiet) if len(ids) > 1 else tuple(map(quiet.__getitem__, ids))
        except KeyError:  # one is not known to be quiet (new from this step on, or its saves changed)
            past = tuple(map(quiet.get, ids, repeat(sys.maxsize)))
        prompt = 0
        if any(map(lt, starts, past)):
            for i in compress(range(len(ids)), map(lt, starts, past)):
                st = tracker.get(ids[i])
                if st is not None:
                    prompt += self.step(st, starts[i], tokens[i], saves)
        return prompt

    def step(self, st: RequestState, computed: int, scheduled: int, saves: list[SaveSpec]) -> int:
        """Plan the request's save for this step into ``saves``; returns its prompt tokens in the step."""
        n = len(st.prompt)
        if computed >= n and (st.save_wait or st.save_from >= n // self.kv_block):
            self._quiet[st.req_id] = n
            return 0  # decoding, its prompt saved (or its save refused): the common case, answered at once
        prompt = prompt_tokens_scheduled(len(st.prompt), computed, scheduled)
        full = min(computed + scheduled, len(st.prompt)) // self.kv_block
        public = st.hit.blocks if st.hit is not None and st.hit.namespace == PUBLIC else 0
        # a prompt not yet past the public chain it was served from gets no copy of it for the tenant;
        # after a refused save, nothing is planned again until the request computes prompt tokens
        if self.write_back and st.tenant not in (None, PUBLIC) and not (public and full <= public) \
                and not (st.save_wait and not prompt):
            spec = save_spec(st.req_id, st.tenant, st.prompt, st.block_table, save_from=st.save_from,
                             computed=computed, scheduled=scheduled, kv_block=self.kv_block,
                             engine_block=self.engine_block, chat=st.save_chat)
            if spec is not None:
                st.save_from = spec.first + len(spec.block_ids) // self.ratio
                st.save_wait = False
                saves.append(spec)
        if self._done(st):
            self._quiet[st.req_id] = n
        else:
            self._quiet.pop(st.req_id, None)
        return prompt

    def load_failed(self, st: RequestState, loaded_tokens: int) -> None:
        """The request's load got ``loaded_tokens`` of its range: the blocks vLLM recomputes may be written back
        (they replace what was corrupt, expired or gone)."""
        self._quiet.pop(st.req_id, None)
        st.save_from = min(st.save_from, (st.computed + loaded_tokens) // self.kv_block)

    def refused(self, st: RequestState, first: int) -> None:
        """The worker did not store the request's blocks from ``first`` on (computed over a failed load,
        or not taken by the write-back queue)."""
        self._quiet.pop(st.req_id, None)
        if first < st.save_from:
            st.save_from, st.save_wait = first, True

    def forget(self, req_id: str) -> None:
        """The request finished: nothing more of it is planned."""
        self._quiet.pop(req_id, None)
