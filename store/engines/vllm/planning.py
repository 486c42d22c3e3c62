"""The scheduler's arithmetic: how many tokens a hit gives vLLM, and which blocks to load and to save.

Two block sizes meet here: kvwarm's ``kv_block`` (what a snapshot holds, 256 by default) and the
engine's ``engine_block`` (vLLM's, 128 on the CPU backend, 16 on CUDA), which divides it.

- A hit is answered in whole engine blocks beyond vLLM's own prefix-cache hit, and leaves at
  least one prompt token to compute (vLLM needs one to produce logits): tokens up to
  ``min(hit, ((prompt - 1) // engine_block) * engine_block)``.
- The load starts at vLLM's hit, which is a multiple of the engine block and may fall inside a
  kvwarm block: the second half of a stored block is loaded then.
- Write-back saves a request's kvwarm blocks as their last token is computed, from the first
  block the store lacks, in the chain they extend (a chain is found only from its first block);
  generated tokens are not saved.

Pure functions over plain values, no vLLM.
"""
from __future__ import annotations

from functools import partial
from itertools import compress, repeat
from operator import itemgetter, not_
from typing import Any, Sequence

from store.engines.vllm.decodes import Decodes
from store.engines.vllm.metadata import LoadSpec, SaveSpec
from store.engines.vllm.validity import Compute
from store.format.header import Layout
from store.format.payload import payload_nbytes
from store.format.precision import Precision

#: Bytes of a snapshot's header and framing, about (token ids and part list as JSON).
HEADER_BYTES = 4096


def matched_tokens(hit_blocks: int, *, kv_block: int, engine_block: int, prompt_tokens: int, computed: int) -> int:
    """Tokens to load beyond vLLM's ``computed`` ones, for a hit of ``hit_blocks`` kvwarm blocks."""
    cap = ((prompt_tokens - 1) // engine_block) * engine_block if prompt_tokens > 0 else 0
    end = min(hit_blocks * kv_block, cap)
    return max(0, end - computed)


def kv_blocks_spanned(start: int, end: int, kv_block: int) -> range:
    """The kvwarm blocks that tokens ``start..end`` lie in."""
    return range(start // kv_block, -(-end // kv_block))


def load_spec(req_id: str, tenant: str, chat: bool, prompt: Sequence[int], block_table: Sequence[int], *,
              start: int, tokens: int, kv_block: int, engine_block: int, deferred: bool = False) -> LoadSpec:
    """What the worker loads for ``tokens`` stored tokens from ``start`` (vLLM's hit).

    ``block_table`` is every engine block of the request, in token order; ``deferred``: the
    request waits for the load (an async load, reported finished by the worker).

    Raises:
        ValueError: the range is not whole engine blocks, or the table does not reach it.
    """
    end = start + tokens
    if start % engine_block or end % engine_block or tokens <= 0:
        raise ValueError(f"a load is whole engine blocks of {engine_block}: got tokens {start}..{end}")
    if len(block_table) < end // engine_block:
        raise ValueError(f"the request has {len(block_table)} engine blocks; tokens {start}..{end} need "
                         f"{end // engine_block}")
    last = kv_blocks_spanned(start, end, kv_block).stop
    return LoadSpec(req_id=req_id, tenant=tenant, chat=chat, token_ids=tuple(prompt[: last * kv_block]),
                    start=start, end=end, block_ids=tuple(block_table[start // engine_block : end // engine_block]),
                    deferred=deferred)


def save_spec(req_id: str, tenant: str, prompt: Sequence[int], block_table: Sequence[int], *, save_from: int,
              computed: int, scheduled: int, kv_block: int, engine_block: int, chat: bool = False) -> SaveSpec | None:
    """The full prompt blocks from ``save_from`` that are computed once this step has run, or ``None``.

    ``computed`` tokens were computed before the step, ``scheduled`` are computed in it.
    """
    done = min(computed + scheduled, len(prompt))
    full = done // kv_block
    if full <= save_from:
        return None
    ratio = kv_block // engine_block
    ids = block_table[save_from * ratio : full * ratio]
    if len(ids) < (full - save_from) * ratio:
        return None  # blocks not allocated yet: they are saved in a later step
    return SaveSpec(req_id=req_id, tenant=tenant, chat=chat, first=save_from,
                    token_ids=tuple(prompt[: full * kv_block]), block_ids=tuple(ids))


#: A :class:`Compute` from a tuple of its fields (``tuple.__new__``, C speed: ``Compute._make`` is Python).
_compute = partial(tuple.__new__, Compute)


def computes_of(scheduler_output: Any) -> tuple[tuple[Compute, ...], Decodes, tuple[tuple[int, int], ...],
                                               tuple[str, ...]]:
    """What a vLLM ``SchedulerOutput`` says the step computes, copies and ends, for the worker's ledger.

    Every scheduled request (new, resumed, running), whether kvwarm tracks it or not: its
    context start, its tokens this step, its new engine blocks (all of them for a new or
    resumed request); the steady decodes (running, no new block) apart, column by column, after
    the others in the step's order; vLLM's block copies; the requests finished or preempted since the last step.
    """
    scheduled = scheduler_output.num_scheduled_tokens
    out = [Compute(nr.req_id, int(nr.num_computed_tokens), int(scheduled.get(nr.req_id, 0)),
                   tuple(int(b) for b in nr.block_ids[0]), replace=True)
           for nr in scheduler_output.scheduled_new_reqs]
    # every running request, every step: column by column, at C speed, and no object per steady decode
    # (vLLM's counts are ints already: int() of each would cost more than all the rest)
    cached = scheduler_output.scheduled_cached_reqs
    ids = tuple(cached.req_ids)
    starts = tuple(cached.num_computed_tokens)
    try:  # every running request is scheduled: its count is there
        tokens = itemgetter(*ids)(scheduled) if len(ids) > 1 else tuple(map(scheduled.__getitem__, ids))
    except KeyError:
        tokens = tuple(map(scheduled.get, ids, repeat(0)))
    news = cached.new_block_ids
    resumed = cached.resumed_req_ids
    steady = list(map(not_, news))  # vLLM gives None for a request without new blocks
    if resumed:
        steady = [s and r not in resumed for s, r in zip(steady, ids)]
    if steady.count(True) == len(ids):
        return tuple(out), Decodes(ids, starts, tokens), *_copies_and_ends(scheduler_output)
    moving = list(map(not_, steady))
    news = [tuple(map(int, new[0])) if new else () for new in compress(news, moving)]
    moved = list(compress(ids, moving))
    out.extend(map(_compute, zip(moved, map(int, compress(starts, moving)), map(int, compress(tokens, moving)), news,
                                 map(resumed.__contains__, moved))))
    decodes = Decodes(tuple(compress(ids, steady)), tuple(compress(starts, steady)), tuple(compress(tokens, steady)))
    return tuple(out), decodes, *_copies_and_ends(scheduler_output)


def _copies_and_ends(scheduler_output: Any) -> tuple[tuple[tuple[int, int], ...], tuple[str, ...]]:
    """vLLM's block copies of the step, and the requests it finished or preempted since the last (sorted)."""
    copies = tuple((int(c[0]), int(c[1])) for c in getattr(scheduler_output, "kv_cache_block_copies", None) or ())
    ended = set(getattr(scheduler_output, "finished_req_ids", None) or ())
    ended |= set(getattr(scheduler_output, "preempted_req_ids", None) or ())
    return copies, tuple(sorted(ended))


def stored_block_bytes(precision: Precision, *, layers: int, kv_heads: int, head_dim: int, kv_block: int) -> int:
    """About how many bytes one stored block takes (what a load reads): its payload and header."""
    layout = Layout(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, block_size=kv_block)
    return payload_nbytes(layout, precision) + HEADER_BYTES


def prompt_tokens_scheduled(prompt_len: int, computed: int, scheduled: int) -> int:
    """How many of a request's ``scheduled`` tokens this step are prompt tokens (the rest decode)."""
    return max(0, min(scheduled, prompt_len - computed))
