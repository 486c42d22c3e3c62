"""Request logs as a replay trace: the logs the pipeline mines, keyed for ``prefill simulate``.

An operator's question, what kvwarm would save on their traffic, is asked of the logs
they already feed the pipeline (docs/logs.md: JSONL or Parquet, a file, a directory
or ``s3://``, text prompts, token ids or block hash ids). :func:`read_log_trace` reads
them with :func:`forecasting.logs.read_logs` (malformed rows are quarantined and
counted, never fatal), keeps one model's rows, tokenises text prompts with the
caller's tokenizer and keys every full block the way :func:`~forecasting.traces.read_kvwarm`
keys ``token_ids`` rows, so a plan the pipeline made from the same logs meets these
blocks (:func:`forecasting.prewarm.plan_blocks`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd

from forecasting.logs import ReadReport, read_logs
from forecasting.mining import Tokenizer, one_model, tokenize_requests
from forecasting.traces import Trace, TraceBuilder, TraceError
from store.keys import block_keys


def trace_from_requests(requests: pd.DataFrame, *, block_size: int, model: str = "simulate",
                        source: str = "the log") -> Trace:
    """A trace of ``requests`` (columns as :func:`forecasting.logs.read_logs` gives them).

    Rows with ``token_ids`` are keyed with :func:`~forecasting.traces.simulation_root`
    of their tenant (full blocks of ``block_size`` tokens); rows with ``hash_ids`` (one
    chained id per block) keep their ids, per tenant. The prompt length is
    ``prompt_tokens`` when logged, else the token count (or ``block_size`` per hash id).

    Raises:
        TraceError: no rows, a bad block size, or rows with prompt text only (tokenise
            them first: :func:`forecasting.mining.tokenize_requests`).
    """
    built = TraceBuilder(block_size, model=model)
    texts_only = 0
    times = pd.to_datetime(requests["timestamp"]).to_numpy(dtype="datetime64[us]").astype(np.int64) / 1e6
    col = {name: requests[name].tolist() if name in requests else [None] * len(requests)
           for name in ("tenant", "token_ids", "hash_ids", "prompt_tokens", "output_tokens")}
    for i, t in enumerate(times.tolist()):
        tenant, tokens, hashes = col["tenant"][i], col["token_ids"][i], col["hash_ids"][i]
        if tokens is not None:
            keys = block_keys(built.root(tenant), tokens)
            n_tokens = len(tokens)
        elif hashes is not None:
            keys = [f"{tenant}/{int(h)}" for h in hashes]
            n_tokens = len(hashes) * block_size
        else:
            texts_only += 1
            continue
        logged, gen = col["prompt_tokens"][i], col["output_tokens"][i]
        built.add(t, tenant, keys, n_tokens if logged is None or logged is pd.NA else int(logged),
                  0 if gen is None or gen is pd.NA else int(gen))
    if texts_only:
        raise TraceError(f"{source}: {texts_only} row(s) have prompt text only: pass the model whose tokenizer "
                         "wrote them (--model) to tokenise them")
    return built.build(source)


def read_log_trace(source: str | Path, *, block_size: int, load_tokenizer: Callable[[str], Tokenizer] | None = None,
                   model: str | None = None, quarantine: str | Path | None = None,
                   storage_options: dict[str, Any] | None = None) -> tuple[Trace, ReadReport]:
    """Read kvwarm request logs (docs/logs.md) as a trace of one model's requests.

    Args:
        source: a log file, a directory tree or an fsspec URL, as the pipeline reads.
        block_size: tokens per block (the serving engine's, as the pipeline's).
        load_tokenizer: the tokenizer of a model name, called (with ``model``, or the
            log's model) only when some rows have prompt text only; it tokenises them
            as mining does (``tokenizer(texts, add_special_tokens=False)``).
        model: keep this model's rows; ``None``: the log must hold one model.
        quarantine: where malformed rows go (JSONL); ``None`` keeps them in the report.

    Returns:
        (trace, the read's report: rows read, used, quarantined).

    Raises:
        TraceError: no usable rows (or none of ``model``), or text rows and no tokenizer.
        forecasting.logs.LogError: the source is missing or holds no log files.
        forecasting.mining.MiningError: several models and no ``model``.
    """
    log = read_logs(source, quarantine=quarantine, storage_options=storage_options)
    requests = one_model(log.requests, model)
    if model is not None and not len(requests):
        have = ", ".join(sorted(set(log.requests["model"]))[:10]) or "none"
        raise TraceError(f"no request of model {model!r} in {source} (its models: {have})")
    if load_tokenizer is not None and (requests["token_ids"].isna() & requests["hash_ids"].isna()).any():
        name = model if model is not None else str(requests["model"].iloc[0])
        requests = tokenize_requests(requests, load_tokenizer(name))
    return trace_from_requests(requests, block_size=block_size, source=str(source)), log.report
