"""Request logs as a replay trace, and a trace as request logs: what the pipeline mines and the replay replays.

An operator's question, what kvwarm would save on their traffic, is asked of the logs
they already feed the pipeline (docs/reference/logs.md: JSONL or Parquet, a file, a directory
or ``s3://``, text prompts, token ids or block hash ids). :func:`read_log_trace` reads
them with :func:`forecasting.ingest.logs.read_logs` (malformed rows are quarantined and
counted, never fatal), keeps one model's rows, tokenises text prompts with the
caller's tokenizer and keys every full block the way :func:`~forecasting.ingest.traces.read_kvwarm`
keys ``token_ids`` rows, so a plan the pipeline made from the same logs meets these
blocks (:func:`forecasting.simulate.prewarm.plan_blocks`). :func:`requests_from_trace` goes
the other way: a Mooncake trace as ``hash_ids`` log rows, for the pipeline to mine.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd

from forecasting.ingest.logs import ReadReport, read_logs
from forecasting.ingest.traces import Trace, TraceError, assemble, simulation_root
from forecasting.mining.prefix_tree import Tokenizer, mine_text, one_model, tokenize_requests


def trace_from_requests(requests: pd.DataFrame, *, block_size: int, model: str = "simulate",
                        source: str = "the log") -> Trace:
    """A trace of ``requests`` (columns as :func:`forecasting.ingest.logs.read_logs` gives them).

    Rows with ``token_ids`` are keyed with :func:`~forecasting.ingest.traces.simulation_root`
    of their tenant (full blocks of ``block_size`` tokens). They are walked into prefix
    trees the way mining walks them (:func:`forecasting.mining.prefix_tree.mine_text`, vectorised)
    and each distinct block is keyed once (:meth:`~forecasting.mining.prefix_tree.PrefixTree.all_node_keys`), so the cost
    follows the distinct prefixes, not the requests. Rows with ``hash_ids`` (one chained
    id per block) keep their ids, per tenant. The prompt length is ``prompt_tokens`` when
    logged, else the token count (or ``block_size`` per hash id).

    Raises:
        TraceError: no rows, a bad block size or tenant, or rows with prompt text only
            (tokenise them first: :func:`forecasting.mining.prefix_tree.tokenize_requests`).
    """
    if block_size < 1:
        raise TraceError(f"block size must be positive, got {block_size}")
    n = len(requests)
    none = pd.Series([None] * n, index=requests.index, dtype=object)
    tokens = requests["token_ids"] if "token_ids" in requests else none
    hashes = requests["hash_ids"] if "hash_ids" in requests else none
    has_tokens = tokens.notna().to_numpy()
    has_hashes = ~has_tokens & hashes.notna().to_numpy()
    texts_only = int(n - has_tokens.sum() - has_hashes.sum())
    if texts_only:
        raise TraceError(f"{source}: {texts_only} row(s) have prompt text only: pass the model whose tokenizer "
                         "wrote them (--model) to tokenise them")
    tenants = requests["tenant"].astype(str).to_numpy()
    chains: list[list[int]] = [[] for _ in range(n)]
    names: list[str] = []
    lengths = np.zeros(n, dtype=np.int64)
    rows = np.flatnonzero(has_tokens)
    if len(rows):
        try:
            roots = {t: simulation_root(t, block_size, model=model) for t in sorted(set(tenants[rows]))}
        except ValueError as exc:
            raise TraceError(f"{source}: field 'tenant': {exc}") from exc
        part = pd.DataFrame({"timestamp": requests["timestamp"].to_numpy()[rows], "tenant": tenants[rows],
                             "token_ids": tokens.to_numpy()[rows]})
        tree = mine_text(part, None, roots)
        names = tree.all_node_keys()
        for k, i in enumerate(rows.tolist()):
            chains[i] = tree.path_nodes[tree.offsets[k]:tree.offsets[k + 1]].tolist()
        lengths[rows] = np.diff(tree.seq_offsets)
    intern: dict[str, int] = {}
    for i in np.flatnonzero(has_hashes).tolist():
        ids = hashes.iat[i]
        chains[i] = [intern.setdefault(f"{tenants[i]}/{int(h)}", len(names) + len(intern)) for h in ids]
        lengths[i] = len(ids) * block_size
    times = pd.to_datetime(requests["timestamp"]).to_numpy(dtype="datetime64[us]").astype(np.int64) / 1e6
    logged = requests["prompt_tokens"] if "prompt_tokens" in requests else none
    out = requests["output_tokens"] if "output_tokens" in requests else none
    inp = np.where(logged.notna().to_numpy(), pd.to_numeric(logged, errors="coerce").fillna(0).to_numpy(), lengths)
    gen = pd.to_numeric(out, errors="coerce").fillna(0).to_numpy()
    return assemble(times.tolist(), inp.astype(np.int64).tolist(), gen.astype(np.int64).tolist(), chains,
                    tenants.tolist(), block_size, tuple(names) + tuple(intern), source)


def requests_from_trace(trace: Trace, *, model: str = "mooncake", origin: pd.Timestamp | None = None) -> pd.DataFrame:
    """A trace's requests as log rows (docs/reference/logs.md): what the pipeline mines.

    A Mooncake trace becomes ``hash_ids`` rows (one chained id per block), so mining,
    the planner and the cadence flow run on it as on any log. ``timestamp`` is
    ``origin`` (default: the trace's own start, ``trace.start_s`` Unix seconds) plus the
    trace's time; ``prompt_tokens`` and ``output_tokens`` are the trace's counts.
    """
    start = pd.Timestamp(trace.start_s, unit="s") if origin is None else pd.Timestamp(origin)
    n = len(trace)
    tenants = np.full(n, trace.tenants, dtype=object) if isinstance(trace.tenants, str) else trace.tenants
    ids = [trace.block_ids[trace.offsets[i]:trace.offsets[i + 1]] for i in range(n)]
    return pd.DataFrame({
        "timestamp": (start + pd.to_timedelta(trace.timestamps_s, unit="s")).astype("datetime64[us]"),
        "tenant": pd.Series(tenants, dtype=object), "model": model,
        "hash_ids": pd.Series([a if len(a) else None for a in ids], dtype=object),
        "prompt_tokens": pd.array(trace.input_tokens, dtype="Int64"),
        "output_tokens": pd.array(trace.output_tokens, dtype="Int64")})


def read_log_requests(source: str | Path, *, load_tokenizer: Callable[[str], Tokenizer] | None = None,
                      model: str | None = None, quarantine: str | Path | None = None,
                      storage_options: dict[str, Any] | None = None) -> tuple[pd.DataFrame, ReadReport]:
    """Read kvwarm request logs (docs/reference/logs.md): one model's rows, text tokenised (see :func:`read_log_trace`).

    Raises:
        TraceError: none of ``model``'s rows.
        forecasting.ingest.logs.LogError: the source is missing or holds no log files.
        forecasting.mining.prefix_tree.MiningError: several models and no ``model``.
    """
    log = read_logs(source, quarantine=quarantine, storage_options=storage_options)
    requests = one_model(log.requests, model)
    if model is not None and not len(requests):
        have = ", ".join(sorted(set(log.requests["model"]))[:10]) or "none"
        raise TraceError(f"no request of model {model!r} in {source} (its models: {have})")
    if load_tokenizer is not None and (requests["token_ids"].isna() & requests["hash_ids"].isna()).any():
        name = model if model is not None else str(requests["model"].iloc[0])
        requests = tokenize_requests(requests, load_tokenizer(name))
    return requests, log.report


def read_log_trace(source: str | Path, *, block_size: int, load_tokenizer: Callable[[str], Tokenizer] | None = None,
                   model: str | None = None, quarantine: str | Path | None = None,
                   storage_options: dict[str, Any] | None = None) -> tuple[Trace, ReadReport]:
    """Read kvwarm request logs (docs/reference/logs.md) as a trace of one model's requests.

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
        forecasting.ingest.logs.LogError: the source is missing or holds no log files.
        forecasting.mining.prefix_tree.MiningError: several models and no ``model``.
    """
    requests, report = read_log_requests(source, load_tokenizer=load_tokenizer, model=model, quarantine=quarantine,
                                         storage_options=storage_options)
    return trace_from_requests(requests, block_size=block_size, source=str(source)), report
