"""What the end-to-end engine tests share: prompts, kvwarm config files, ``prefill warm``, requests.

The engine itself is started by :mod:`bench.lib.vllm_engine` (from the engine venv, stopped
by pid). Here is the project side: the prompts come from the tiny model's corpus through
its own tokenizer, the stored prefixes are made by the real ``prefill warm`` CLI (this
venv's python) where the CLI is the point (the bf16 store: the keys contract), elsewhere by
the same job in this process, and every store, pool and config file lives in the test's directory.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator, Sequence

import yaml

from bench.lib.vllm_engine import ROOT

#: vLLM's CPU block size (its default) and kvwarm's (the config default): one kvwarm block is two of vLLM's
VLLM_BLOCK, KVWARM_BLOCK = 128, 256
TOKENS = 16  # greedy tokens generated per request
TENANT = "acme"
#: the vLLM ``cache_salt`` of each tenant selected by one (config ``tenants.<name>.cache_salts``; 16
#: characters at least). acme, the connector's default tenant (requests without a salt), has none: a
#: default tenant that lists cache_salts is refused (a request without a salt would act as it).
SALTS = {"beta": "salt-beta-0123456789abcdef"}
#: the config's ``tenants`` section of the engine tests: acme (the default) and beta (by its salt)
TENANTS = {TENANT: {}, **{name: {"cache_salts": [salt]} for name, salt in SALTS.items()}}
#: Two implementations computing the same KV in bf16 (transformers in ``prefill warm``, vLLM's
#: CPU kernels in the engine) differ by rounding: measured on kvwarm-tiny, 1 % (relative L2) in
#: layers 1-3 and 0.4 % in layer 0's K (RoPE), V of layer 0 bit-equal. vLLM's logits are bf16,
#: in steps of 1/16 nat near the top ones here, and that KV difference moves them by a step or
#: two. Where vLLM's own top two choices are at most two steps apart, either may come out, and
#: the continuations then part (both are right: the model cannot tell them apart in bf16). KV
#: the engine itself computed, stored losslessly (bf16 write-back), must give exactly its tokens.
NEAR_TIE = 0.13
#: a low prefill rate pinned for the tiny model, so that every stored hit "beats recomputing" whatever
#: the machine's load does to the measured rates (the cost decision is unit-tested on its own)
SLOW_PREFILL = 100.0
#: the SeaweedFS credentials the S3 engine tests give the engine and the store
S3_ENV = {"KVWARM_TEST_KEY": "test", "KVWARM_TEST_SECRET": "test", "AWS_DEFAULT_REGION": "us-east-1"}


def s3_store(endpoint: str) -> dict[str, Any]:
    """The config's ``store`` section for a test SeaweedFS at ``endpoint`` (credentials from :data:`S3_ENV`;
    short timeouts, no retries: a killed S3 is seen at once)."""
    return {"s3": {"endpoint_url": endpoint, "access_key_env": "KVWARM_TEST_KEY", "secret_key_env": "KVWARM_TEST_SECRET",
                   "op_timeout_s": 4, "connect_timeout_s": 1, "read_timeout_s": 3, "retries": 0}}


def tiny_dir() -> Path:
    """The built-in ``kvwarm-tiny`` model's directory (built once per machine)."""
    from prefill.models import resolve

    return resolve("kvwarm-tiny")


@lru_cache(maxsize=1)
def tokenizer() -> Any:
    """The tiny model's tokenizer (the one vLLM and ``prefill warm`` load from its directory)."""
    from prefill.models import load_tokenizer

    return load_tokenizer("kvwarm-tiny")


@lru_cache(maxsize=1)
def corpus_lines() -> tuple[str, ...]:
    lines = (ROOT / "prefill" / "assets" / "corpus.jsonl").read_text().splitlines()
    return tuple(json.loads(line)["prompt"] for line in lines if line.strip())


def corpus_line(i: int) -> str:
    return corpus_lines()[i]


@lru_cache(maxsize=1)
def corpus_ids() -> tuple[int, ...]:
    """The tiny model's corpus, tokenised as ``prefill warm`` tokenises text (no special tokens)."""
    rows = tokenizer()([t + "\n" for t in corpus_lines()], add_special_tokens=False)["input_ids"]
    return tuple(int(t) for row in rows for t in row)


def segment(start: int, length: int) -> list[int]:
    """``length`` corpus tokens from ``start`` (distinct starts give distinct prompts)."""
    ids = corpus_ids()
    if start + length > len(ids):
        raise ValueError(f"the corpus has {len(ids)} tokens; {start}+{length} is past its end")
    return list(ids[start:start + length])


def expected_load(stored_tokens: int, prompt_len: int, local_hit: int = 0) -> int:
    """Tokens the connector should load: whole vLLM blocks of the stored chain beyond vLLM's own hit,
    leaving at least one prompt token to compute."""
    cap = (prompt_len - 1) // VLLM_BLOCK * VLLM_BLOCK
    return max(0, min(stored_tokens, cap) - local_hit)


def write_config(path: Path, *, store_url: str, compression: str = "bf16", **sections: Any) -> Path:
    """A kvwarm config file for one test: its store, its pool under the test dir, ``compression``.

    ``sections`` are merged into the top level (``loader={...}``, ``tenants={...}``...).
    """
    path = Path(path)
    cfg: dict[str, Any] = {
        "kv_cache": {"compression": compression, "block_size": KVWARM_BLOCK},
        "store": {"url": store_url},
        "loader": {"pool_dir": str(path.parent / "pool"), "pool_bytes": "256MiB"},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    return path


def entry(ids: Sequence[int] | None = None, *, text: str | None = None, tenant: str = TENANT, chat: bool = False,
          ttl_s: float | None = None) -> dict[str, Any]:
    """One prefix for :func:`prefill_warm` (a plan entry: token ids or text, for a tenant)."""
    e: dict[str, Any] = {"tenant": tenant}
    if ids is not None:
        e["token_ids"] = [int(t) for t in ids]
    if text is not None:
        e.update(text=text, chat=chat)
    if ttl_s is not None:
        e["ttl_s"] = ttl_s
    return e


def prefill_warm(config: Path, entries: Sequence[dict[str, Any]], *, model: str | Path | None = None,
                 store: str | None = None, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Store ``entries`` (see :func:`entry`) with the real ``prefill warm --model PATH`` CLI, bf16 compute.

    One call for many prefixes and tenants (each call loads the model: tens of seconds here).
    Returns the CLI's JSON report. Raises ``AssertionError`` with its output when it fails.
    """
    config = Path(config)
    listing = config.parent / f"prefixes-{len(list(config.parent.glob('prefixes-*.jsonl')))}.jsonl"
    listing.write_text("".join(json.dumps(e) + "\n" for e in entries))
    cmd = [sys.executable, "-m", "prefill.cli", "warm", "--model", str(model or tiny_dir()), "--config", str(config),
           "--file", str(listing), "--dtype", "bf16", "--device", "cpu", "--json"]
    if store is not None:
        cmd += ["--store", store]
    run_env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    done = subprocess.run(cmd, cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"prefill warm failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@lru_cache(maxsize=1)
def tiny_model() -> Any:
    """The tiny model, loaded once per test session as ``prefill warm --model PATH --dtype bf16`` loads it."""
    from prefill.models import load_model

    return load_model(str(tiny_dir()), dtype="bf16", device="cpu")


@contextmanager
def environment(env: dict[str, str] | None) -> Iterator[None]:
    """``env`` set in this process for the block, the old values back after it."""
    old = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def prefill_here(config: Path, entries: Sequence[dict[str, Any]], *, store: str | None = None,
                 env: dict[str, str] | None = None) -> dict[str, Any]:
    """Store ``entries`` with the job ``prefill warm`` runs (``prefill.warm.warm``), in this process.

    The same code, model and bf16 compute as :func:`prefill_warm`, without a new interpreter and
    model load per call (seconds each on two cores); the CLI itself is tested by the fixtures
    that call :func:`prefill_warm` (the keys contract). Returns the job's report as a dict.
    """
    from prefill.warm import warm
    from store.config import load_config
    from store.plan import PlanEntry
    from store.tiers.store import Store

    cfg = load_config(config)
    plan = [PlanEntry(**{**e, "token_ids": tuple(e["token_ids"])} if "token_ids" in e else e) for e in entries]
    with environment(env):
        opened = Store.open(store or cfg.store.url, cfg)
        try:
            return warm(plan, loaded=tiny_model(), store=opened, config=cfg).as_dict()
        finally:
            opened.close()


def request(ids: Sequence[int], *, salt: str | None = None, tenant: str | None = None,
            max_tokens: int = TOKENS) -> dict[str, Any]:
    """One request of a driver step (``tenant``: through ``kv_transfer_params``)."""
    r: dict[str, Any] = {"ids": [int(t) for t in ids], "max_tokens": max_tokens}
    if salt is not None:
        r["cache_salt"] = salt
    if tenant is not None:
        r["kv_transfer_params"] = {"kvwarm_tenant": tenant}
    return r


def engine_spec(steps: list[dict[str, Any]], *, extra: dict[str, Any] | None = None,
                policy: str = "recompute", model: Path | None = None, **engine: Any) -> dict[str, Any]:
    """A :mod:`bench.lib.vllm_driver` spec for the tiny model (with kvwarm's connector when ``extra``)."""
    spec: dict[str, Any] = {"engine": {"model": str(model or tiny_dir()), "max_model_len": 2048, **engine},
                            "steps": steps}
    if extra is not None:
        spec["connector"] = {"extra": extra, "policy": policy}
    return spec


def connector(config: Path, **extra: Any) -> dict[str, Any]:
    """The connector's extra config for a test store (``tenant`` acme, the pinned prefill rate)."""
    return {"config": str(config), "tenant": TENANT, "prefill_tokens_per_s": SLOW_PREFILL, **extra}


def margins(logprobs: Sequence[dict[str, float]]) -> list[float]:
    """Per generated position, the gap between the top two logprobs vLLM saw."""
    out = []
    for pos in logprobs:
        top = sorted(pos.values(), reverse=True)
        out.append(top[0] - top[1] if len(top) > 1 else float("inf"))
    return out


def greedy_mismatch(got: Sequence[int], cold: Sequence[int], cold_margins: Sequence[float]) -> str | None:
    """Why ``got`` is not vLLM's cold continuation, or ``None`` when it is.

    Tokens must be equal up to the end, or up to a position where the cold choice was a near
    tie (:data:`NEAR_TIE`): there the two may part, and what follows is not compared.
    """
    for i, (a, b) in enumerate(zip(got, cold)):
        if a != b:
            if cold_margins[i] < NEAR_TIE:
                return None
            return f"token {i}: {a} != {b}, where vLLM's top two were {cold_margins[i]:.3f} nats apart"
    return None if len(got) == len(cold) else f"{len(got)} tokens, not {len(cold)}"


def tie_aware_agreement(got: Sequence[int], cold: Sequence[int], cold_margins: Sequence[float]) -> tuple[int, int]:
    """(tokens that agree, tokens compared) of one continuation against vLLM's cold one.

    After the two part at a near tie of vLLM's own (:data:`NEAR_TIE`), nothing more is compared;
    after they part anywhere else, every later token counts as a disagreement (the stored KV
    changed a decision the model was sure of).
    """
    for i, (a, b) in enumerate(zip(got, cold)):
        if a != b:
            return (i, i) if cold_margins[i] < NEAR_TIE else (i, len(cold))
    return len(cold), len(cold)


def agreement(a: Sequence[int], b: Sequence[int]) -> float:
    """Share of positions where two greedy continuations agree."""
    n = max(len(a), len(b))
    return sum(x == y for x, y in zip(a, b)) / n if n else 1.0


def count(stats: dict[str, Any], name: str, reason: str | None = None) -> float:
    """A connector counter from ``stats()`` (``name:reason`` for the labelled ones; 0 when absent)."""
    return stats.get(name if reason is None else f"{name}:{reason}", 0)


def reasons(stats: dict[str, Any], name: str) -> dict[str, float]:
    """The ``reason`` values of a labelled counter (``misses`` -> ``{"absent": 3, ...}``)."""
    return {k.split(":", 1)[1]: v for k, v in stats.items() if k.startswith(name + ":") and v}


def outcome(call: dict[str, Any]) -> dict[str, Any]:
    """What kvwarm reported for one request (its ``kv_transfer_params["kvwarm"]``)."""
    return (call.get("kv_transfer_params") or {}).get("kvwarm") or {}


def names_of(config: Path, tenant: str, ids: Sequence[int]) -> list[str]:
    """Object names of ``ids``'s full kvwarm blocks under ``tenant``'s plain root (the tiny model)."""
    from store.config import load_config
    from store.identity.fingerprint import identity_from_dir
    from store.identity.keys import block_chain
    from store.tiers.base import object_name

    cfg = load_config(config)
    root = identity_from_dir(tiny_dir()).key_root(cfg.kv_cache.precision(), KVWARM_BLOCK, cfg.tenant(tenant).salt)
    return [object_name(tenant, b.key) for b in block_chain(root, ids)]
