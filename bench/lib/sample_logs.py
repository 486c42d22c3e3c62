"""Deterministic sample request logs for the demo and the flow tests (docs/reference/logs.md schema).

Three tenants, each with two or three system prompts taken unchanged from the CC0
prompt set bundled in ``prefill/assets/corpus.jsonl``, followed by varied user
questions; about one request in ten is noise (a prompt no one else sends). Requests
arrive at the hourly rates of three real ServeGen clients (``tests/data/servegen``,
Apache-2.0), scaled to a few thousand requests, over ``days`` days: day ``d`` uses
the ServeGen day ``d mod 2`` (the fixture holds two days). Same seed, same bytes.

Regenerate the bundled file with::

    python -m bench.lib.sample_logs --out flows/data/sample_logs.jsonl.gz
"""
from __future__ import annotations

import argparse
import gzip
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from bench.lib.servegen import load_servegen

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "prefill" / "assets" / "corpus.jsonl"
SERVEGEN = ROOT / "tests" / "data" / "servegen"
DEFAULT_OUT = ROOT / "flows" / "data" / "sample_logs.jsonl.gz"
DEFAULT_START = pd.Timestamp("2026-03-02 00:00")

#: tenant -> (ServeGen client, corpus rows of its system prompts, their popularity)
TENANTS: dict[str, tuple[str, tuple[int, ...], tuple[float, ...]]] = {
    "acme": ("chunk-0", (1, 3, 7), (0.6, 0.3, 0.1)),
    "globex": ("chunk-5", (12, 20), (0.7, 0.3)),
    "initech": ("chunk-17", (31, 44, 58), (0.5, 0.35, 0.15)),
}

_ASK = ("Can you help me with", "Please explain", "I need advice on", "Write a short note about",
        "What is the best way to handle", "Give me three ideas for", "Summarise the key points of",
        "How would you approach", "Compare two options for", "Draft a reply about")
_TOPIC = ("my order 4471", "a refund request", "the quarterly budget", "a slow database query",
          "onboarding a new colleague", "a customer complaint", "travel plans for May", "a failing unit test",
          "pricing for the premium plan", "a memory leak", "the team offsite", "a delayed shipment",
          "password resets", "a contract renewal", "the release checklist", "an outage post-mortem")
_TAIL = ("", " Keep it brief.", " Use bullet points.", " Explain it to a beginner.", " Be precise.",
         " Include an example.")


@dataclass(frozen=True)
class SampleSpec:
    """What to generate: ``requests`` in total (approximately), over ``days`` from ``start``."""

    days: int = 3
    requests: int = 3000
    noise: float = 0.1
    seed: int = 7
    start: pd.Timestamp = DEFAULT_START
    model: str = "kvwarm-tiny"


def _corpus() -> list[str]:
    with CORPUS.open(encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def hourly_rates(days: int) -> dict[str, np.ndarray]:
    """Each tenant's relative requests per hour over ``days`` (ServeGen day ``d mod 2``)."""
    table = load_servegen(SERVEGEN, bucket=pd.Timedelta(hours=1))
    out = {}
    for tenant, (client, _, _) in TENANTS.items():
        y = table.loc[table["unique_id"] == client, "y"].to_numpy(dtype=np.float64)
        per_day = [y[24 * (d % 2): 24 * (d % 2) + 24] for d in range(days)]
        out[tenant] = np.concatenate(per_day)
    return out


def generate(spec: SampleSpec = SampleSpec()) -> list[dict]:
    """The sample log as rows (dicts in the docs/reference/logs.md schema), sorted by time."""
    rng = np.random.default_rng(spec.seed)
    corpus = _corpus()
    rates = hourly_rates(spec.days)
    scale = spec.requests / sum(float(r.sum()) for r in rates.values())
    used = {i for _, rows, _ in TENANTS.values() for i in rows}
    noise_pool = [p for i, p in enumerate(corpus) if i not in used]
    t0 = (spec.start - pd.Timestamp("1970-01-01")).total_seconds()
    rows = []
    for tenant, (_, prompt_rows, weights) in TENANTS.items():
        systems = [corpus[i] for i in prompt_rows]
        counts = rng.poisson(rates[tenant] * scale)
        for hour, n in enumerate(counts):
            for t in np.sort(rng.uniform(0, 3600, size=n)):
                question = f"{_ASK[rng.integers(len(_ASK))]} {_TOPIC[rng.integers(len(_TOPIC))]}?{_TAIL[rng.integers(len(_TAIL))]}"
                if rng.random() < spec.noise:
                    prompt = f"{noise_pool[rng.integers(len(noise_pool))]}\n\nUser: {question}"
                else:
                    system = systems[rng.choice(len(systems), p=np.asarray(weights))]
                    prompt = f"{system}\n\nUser: {question}"
                rows.append({"timestamp": round(t0 + hour * 3600 + float(t), 3), "tenant": tenant,
                             "model": spec.model, "prompt": prompt,
                             "output_tokens": int(rng.integers(20, 400)),
                             "request_id": f"{tenant}-{len(rows):06d}"})
    rows.sort(key=lambda r: (r["timestamp"], r["request_id"]))
    return rows


def write(rows: list[dict], out: str | Path = DEFAULT_OUT) -> Path:
    """Write ``rows`` as JSONL, gzipped (with a fixed mtime, so the bytes are reproducible) for ``.gz``."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows).encode("utf-8")
    if out.suffix == ".gz":
        buf = io.BytesIO()
        with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
            gz.write(text)
        out.write_bytes(buf.getvalue())
    else:
        out.write_bytes(text)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--days", type=int, default=SampleSpec.days)
    p.add_argument("--requests", type=int, default=SampleSpec.requests)
    p.add_argument("--seed", type=int, default=SampleSpec.seed)
    a = p.parse_args(argv)
    rows = generate(SampleSpec(days=a.days, requests=a.requests, seed=a.seed))
    path = write(rows, a.out)
    print(f"wrote {len(rows)} requests to {path} ({path.stat().st_size / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
