"""The tokens per hash id of a Mooncake-format trace: given and checked, or inferred from its rows.

A row's ``hash_ids`` cover its prompt in blocks: ``ceil(input_length / block) == len(hash_ids)``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from store.errors import BadInputError

#: tokens per hash id in the Mooncake traces (FAST'25)
MOONCAKE_BLOCK_TOKENS = 512


class TraceError(BadInputError):
    """A trace file is missing, unreadable or has a malformed row (the message names it)."""


def _fits(lengths: np.ndarray, counts: np.ndarray, block: int) -> np.ndarray:
    return -(-lengths // block) == counts


def mooncake_block_tokens(lengths: np.ndarray, counts: np.ndarray, *, path: str | Path = "trace",
                          wheres: Sequence[str] | None = None, block_tokens: int | None = None) -> int:
    """The tokens per hash id of a trace whose rows have ``lengths`` tokens in ``counts`` hash ids.

    ``block_tokens`` given: checked against every row. Otherwise the first that every row
    fits (``ceil(length / block) == count``) of Mooncake's 512, the powers of two from 16 to
    4096, and the smallest size every row fits.

    Raises:
        TraceError: a row that contradicts the given size (its line and numbers), or no size
            that every row fits.
    """
    def first_bad(block: int) -> str:
        k = int(np.argmin(_fits(lengths, counts, block)))
        where = wheres[k] if wheres is not None else f"{path} row {k + 1}"
        return (f"{where}: input_length {int(lengths[k])} needs ceil({int(lengths[k])} / {block}) = "
                f"{int(-(-lengths[k] // block))} hash ids of {block} tokens, the row has {int(counts[k])}")

    if block_tokens is not None:
        if not (isinstance(block_tokens, int) and block_tokens >= 1):
            raise TraceError(f"the block size must be a positive number of tokens, got {block_tokens!r}")
        if len(lengths) and not _fits(lengths, counts, block_tokens).all():
            raise TraceError(f"{path}: the rows' lengths contradict {block_tokens}-token blocks: {first_bad(block_tokens)}; "
                             "give the trace's own block size (--block-tokens), or leave it out to infer it")
        return block_tokens
    if not len(lengths):
        return MOONCAKE_BLOCK_TOKENS
    for block in (MOONCAKE_BLOCK_TOKENS, *(1 << k for k in range(4, 13))):
        if _fits(lengths, counts, block).all():
            return block
    # every row allows ceil(length / count) <= block < length / (count - 1): the sizes all rows fit
    ok = counts > 0
    if ok.all() and (lengths > 0).all():
        lo = int(np.max(-(-lengths // counts)))
        many = counts > 1
        hi = int(np.min(-(-lengths[many] // (counts[many] - 1)) - 1)) if many.any() else lo
        if lo <= hi and _fits(lengths, counts, lo).all():
            return lo
    raise TraceError(f"{path}: no block size fits every row's input_length and hash ids (Mooncake's 512: "
                     f"{first_bad(MOONCAKE_BLOCK_TOKENS)}); give --block-tokens to see which rows contradict yours")
