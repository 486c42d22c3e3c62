"""The prefix tree of a log's requests, whichever way the log names their prompts.

Logs name a prompt by text, by token ids or by block hash ids (docs/reference/logs.md; the Mooncake
traces are the last kind). :func:`mine_requests` picks the miner that fits: rows with
tokens or text are tokenised and keyed with the store's keys
(:func:`forecasting.mining.prefix_tree.mine_text`); a log whose rows carry hash ids only
is mined from the ids (:func:`forecasting.mining.prefix_tree.mine_hash_log`). The mining
flow and the short-cadence planner both call it, so a Mooncake-format log runs through
the pipeline end to end.
"""
from __future__ import annotations

from typing import Mapping

import pandas as pd

from forecasting.mining.prefix_tree import MiningError, PrefixTree, Tokenizer, mine_hash_log, mine_text, one_model
from store.identity.keys import KeyRoot


def hash_only(requests: pd.DataFrame) -> bool:
    """Whether every row names its prompt by hash ids only (no text, no token ids)."""
    if "hash_ids" not in requests or not len(requests):
        return False
    for name in ("token_ids", "prompt"):
        if name in requests and requests[name].notna().any():
            return False
    return bool(requests["hash_ids"].notna().all())


def mine_requests(requests: pd.DataFrame, *, block_size: int, tokenizer: Tokenizer | None = None,
                  roots: KeyRoot | Mapping[str, KeyRoot] | None = None, model: str | None = None) -> PrefixTree:
    """Mine ``requests`` (columns as :func:`forecasting.ingest.logs.read_logs` gives them) into prefix trees.

    Args:
        requests: the log rows, in time order.
        block_size: tokens per block. For text and token ids it must equal the roots'
            block size; for hash ids it is the tokens each id stands for.
        tokenizer: for rows with prompt text only.
        roots: the tenants' key roots (needed unless the rows carry hash ids only).
        model: mine only this model's rows (needed when the log holds several).

    Raises:
        MiningError: text or token rows without ``roots``, roots of another block size, or
            the errors of the miner used.
    """
    requests = one_model(requests, model)
    if hash_only(requests):
        return mine_hash_log(requests, block_size=block_size)
    if roots is None:
        raise MiningError("rows with text or token ids are keyed with the store's keys: pass the tenants' key roots")
    sizes = {r.block_size for r in ([roots] if isinstance(roots, KeyRoot) else roots.values())}
    if sizes - {block_size}:
        raise MiningError(f"the key roots are for block size {sorted(sizes)}, not {block_size}")
    return mine_text(requests, tokenizer, roots)
