"""Request logs with a known structure, for the mining tests (deterministic for a seed).

Tenants ``acme`` and ``bolt`` send prompts built from templates with known hourly
patterns; every tenant (``cira`` only) sends noise prompts that share nothing. Each
template is a list of segments (a shared system prompt, then the template body), each
padded with filler words so that the template ends exactly on a block boundary and is
followed by a newline: byte-level BPE never merges across "\\n" + letter, so every
request's tokens begin with exactly the template's tokens, and the template is the
longest common block-aligned prefix of its requests. The user part after it is two
to four random words (different for every request), so a template's requests are
near-duplicates (Jaccard well above 0.85) and form one family. Malformed rows come with the reason the
reader must give.

Prompts are real (tests/data/prompts, CC0); the tokenizer is a byte-level BPE trained
here on them, wrapped in ``PreTrainedTokenizerFast`` (no download).
"""
from __future__ import annotations

import csv
import datetime as dt
import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from store.identity.keys import KeyRoot
from store.identity.tenant import Tenant
from tests.store.factories import make_root

PROMPTS_CSV = Path(__file__).resolve().parents[1] / "data" / "prompts" / "prompts.csv"
START = pd.Timestamp("2026-03-02 00:00:00")
MODEL = "kvwarm-tiny"
_FILLERS = (" a", " the", " of", " and")


@functools.lru_cache(maxsize=None)
def prompts() -> tuple[str, ...]:
    """The 40 real prompts of tests/data/prompts/prompts.csv."""
    with PROMPTS_CSV.open(newline="", encoding="utf-8") as fh:
        return tuple(row["prompt"] for row in csv.DictReader(fh))


@functools.lru_cache(maxsize=None)
def words() -> tuple[str, ...]:
    """Lower-case words of the prompts, sorted: the vocabulary of user text and noise."""
    return tuple(sorted({w.lower() for p in prompts() for w in re.findall(r"[A-Za-z]{3,}", p)}))


@functools.lru_cache(maxsize=None)
def make_tokenizer(vocab_size: int = 1200):
    """A byte-level BPE trained on the prompts, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(prompts(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


@dataclass(frozen=True)
class Template:
    """A prompt template: block-aligned segments, an hourly pattern, how its requests are logged."""

    name: str
    tenant: str
    parts: tuple[str, ...]
    hourly: tuple[int, ...]
    as_tokens: bool = False

    @property
    def text(self) -> str:
        return "".join(self.parts)


@dataclass(frozen=True)
class GeneratedLog:
    """Valid rows (time order) with their template, malformed rows with their reason."""

    rows: tuple[dict[str, Any], ...]
    template_of_row: tuple[str | None, ...]
    bad: tuple[tuple[Any, str], ...]
    templates: tuple[Template, ...]
    system_prompts: dict[str, str]
    days: int
    block_size: int

    def template(self, name: str) -> Template:
        return next(t for t in self.templates if t.name == name)

    def hourly_counts(self, *names: str) -> np.ndarray:
        """Requests per hour over the whole log from the named templates, summed."""
        return sum(np.tile(np.asarray(self.template(n).hourly, dtype=np.float64), self.days) for n in names)

    def total_counts(self) -> np.ndarray:
        """All valid requests per hour."""
        hours = [int((row_time(r["timestamp"]) - START) // pd.Timedelta("1h")) for r in self.rows]
        return np.bincount(hours, minlength=24 * self.days).astype(np.float64)


TENANTS = ("acme", "bolt", "cira")


@functools.lru_cache(maxsize=None)
def key_roots(block_size: int = 16) -> dict[str, KeyRoot]:
    """One KeyRoot per tenant of the generated logs (each with its own salt)."""
    return {t: make_root(Tenant.derive(t, f"{t}-secret"), block_size=block_size) for t in TENANTS}


@functools.lru_cache(maxsize=None)
def standard_log() -> GeneratedLog:
    """The default generated log with the shared tokenizer (cached: tests only read it)."""
    return generate_logs(make_tokenizer())


def aligned(tokenizer, prefix: str, text: str, block_size: int) -> str:
    """``text`` padded with filler words and a newline so ``prefix + result`` ends on a block."""
    seg = text.rstrip()
    assert seg[:1].isalpha(), "segments must start with a letter (no BPE merge across the boundary)"
    for i in range(400):
        n = len(tokenizer(prefix + seg + "\n", add_special_tokens=False)["input_ids"])
        if n % block_size == 0:
            return seg + "\n"
        seg += _FILLERS[i % len(_FILLERS)]
    raise AssertionError("could not block-align a segment")


def generate_logs(tokenizer, *, block_size: int = 16, days: int = 2, seed: int = 7,
                  noise_per_hour: int = 1) -> GeneratedLog:
    """A log of ``days`` days from :data:`START` with the templates below, noise and bad rows."""
    p = prompts()
    system = aligned(tokenizer, "", p[5][:300].rsplit(" ", 1)[0], block_size)
    a1 = aligned(tokenizer, system, p[1], block_size)
    a2 = aligned(tokenizer, system, p[2], block_size)
    business = (1,) * 8 + (6,) * 10 + (2,) * 6
    evening = (0,) * 6 + (2,) * 12 + (5,) * 6
    sparse = tuple(2 if h in (2, 3, 4) else 0 for h in range(24))
    templates = (
        Template("acme-a1", "acme", (system, a1), business),
        Template("acme-a2", "acme", (system, a2), evening),
        Template("bolt-b1", "bolt", (aligned(tokenizer, "", p[3], block_size),), (3,) * 24, as_tokens=True),
        Template("bolt-b2", "bolt", (aligned(tokenizer, "", p[4], block_size),), sparse),
    )
    rng = np.random.default_rng(seed)
    vocab = words()
    events: list[tuple[float, str, str | None, str, bool]] = []
    for day in range(days):
        for hour in range(24):
            base = (START + pd.Timedelta(days=day, hours=hour)).timestamp()
            for t in templates:
                n = t.hourly[hour]
                for j in range(n):
                    when = base + (j + rng.uniform(0.05, 0.95)) * 3600 / n
                    user = " ".join(rng.choice(vocab, size=int(rng.integers(2, 5))))
                    events.append((when, t.tenant, t.name, t.text + user.capitalize(), t.as_tokens))
            for tenant in ("acme", "bolt", "cira"):
                for j in range(noise_per_hour):
                    when = base + (j + rng.uniform(0.05, 0.95)) * 3600 / noise_per_hour
                    noise = " ".join(rng.choice(vocab, size=int(rng.integers(30, 60))))
                    events.append((when, tenant, None, noise.capitalize(), False))
    events.sort(key=lambda e: e[0])
    rows, names = [], []
    for i, (when, tenant, name, text, as_tokens) in enumerate(events):
        row: dict[str, Any] = {"timestamp": round(when, 3), "tenant": tenant, "model": MODEL, "request_id": f"r{i}",
                               "output_tokens": int(rng.integers(1, 500))}
        if i % 5 == 0:  # some producers log ISO 8601 times
            row["timestamp"] = dt.datetime.fromtimestamp(round(when, 3), dt.timezone.utc).isoformat().replace("+00:00", "Z")
        if as_tokens:
            row["token_ids"] = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            row["prompt"] = text
        rows.append(row)
        names.append(name)
    return GeneratedLog(tuple(rows), tuple(names), _bad_rows(), templates, {"acme": system}, days, block_size)


def _bad_rows() -> tuple[tuple[Any, str], ...]:
    ok = {"timestamp": START.timestamp() + 60, "tenant": "acme", "model": MODEL, "prompt": "Hello there"}
    return (
        ("{not json", "invalid_json"),
        ("[1, 2, 3]", "not_an_object"),
        ({**ok, "timestamp": "yesterday"}, "bad_timestamp"),
        ({**ok, "timestamp": None}, "bad_timestamp"),
        ({**ok, "timestamp": float("nan")}, "bad_timestamp"),
        ({**ok, "tenant": "Acme Corp"}, "bad_tenant"),
        ({k: v for k, v in ok.items() if k != "tenant"}, "bad_tenant"),
        ({**ok, "model": ""}, "bad_model"),
        ({**ok, "prompt": 42}, "bad_prompt"),
        ({**ok, "prompt": None, "token_ids": [1, -2, 3]}, "bad_token_ids"),
        ({**ok, "prompt": None, "token_ids": [1, True]}, "bad_token_ids"),
        ({**ok, "hash_ids": "abc"}, "bad_hash_ids"),
        ({**ok, "prompt": ""}, "no_prompt"),
        ({**ok, "output_tokens": -1}, "bad_count"),
        ({**ok, "latency_ms": "fast"}, "bad_latency"),
    )


def parquet_bad_rows() -> tuple[tuple[dict[str, Any], str], ...]:
    """Malformed rows that still fit the Parquet schema of :func:`write_parquet`."""
    ok = {"timestamp": START.timestamp() + 60, "tenant": "acme", "model": MODEL, "prompt": "Hello there"}
    return (
        ({**ok, "timestamp": None}, "bad_timestamp"),
        ({**ok, "timestamp": float("nan")}, "bad_timestamp"),
        ({**ok, "timestamp": -5.0}, "bad_timestamp"),
        ({**ok, "tenant": "Bad Name"}, "bad_tenant"),
        ({**ok, "tenant": None}, "bad_tenant"),
        ({**ok, "model": None}, "bad_model"),
        ({**ok, "prompt": None, "token_ids": [5, -1]}, "bad_token_ids"),
        ({**ok, "prompt": None, "token_ids": [2**33]}, "bad_token_ids"),
        ({**ok, "prompt": None}, "no_prompt"),
        ({**ok, "output_tokens": -3}, "bad_count"),
    )


def write_jsonl(log: GeneratedLog, root: Path, *, bad: bool = True) -> list[Path]:
    """One JSONL file per day under ``root/date=YYYY-MM-DD/``; bad rows go into the first day."""
    files: dict[str, list[str]] = {}
    for row in log.rows:
        files.setdefault(_day(row["timestamp"]), []).append(json.dumps(row))
    if bad:
        first = files[min(files)]
        for i, (raw, _) in enumerate(log.bad):
            first.insert(3 * i + 1, raw if isinstance(raw, str) else json.dumps(raw))
    out = []
    for day, lines in files.items():
        path = root / f"date={day}" / "part-0.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        out.append(path)
    return out


PARQUET_SCHEMA = pa.schema([("timestamp", pa.float64()), ("tenant", pa.string()), ("model", pa.string()),
                            ("prompt", pa.string()), ("token_ids", pa.list_(pa.int64())),
                            ("request_id", pa.string()), ("output_tokens", pa.int64())])


def write_parquet(log: GeneratedLog, root: Path, *, bad: bool = True) -> list[Path]:
    """One Parquet file per day under ``root/date=YYYY-MM-DD/`` (float seconds timestamps)."""
    files: dict[str, list[dict[str, Any]]] = {}
    for row in log.rows:
        files.setdefault(_day(row["timestamp"]), []).append({**row, "timestamp": row_time(row["timestamp"]).timestamp()})
    if bad:
        first = files[min(files)]
        for i, (raw, _) in enumerate(parquet_bad_rows()):
            first.insert(3 * i + 1, raw)
    out = []
    for day, rows in files.items():
        path = root / f"date={day}" / "part-0.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        cols = {f.name: [r.get(f.name) for r in rows] for f in PARQUET_SCHEMA}
        pq.write_table(pa.table(cols, schema=PARQUET_SCHEMA), path)
        out.append(path)
    return out


def row_time(value: Any) -> pd.Timestamp:
    """A row's timestamp (epoch seconds or ISO 8601) as a naive UTC Timestamp."""
    if isinstance(value, str):
        return pd.Timestamp(value).tz_convert("UTC").tz_localize(None)
    return pd.Timestamp(value, unit="s")


def _day(value: Any) -> str:
    return row_time(value).strftime("%Y-%m-%d")
