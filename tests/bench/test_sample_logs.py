"""The sample log generator: deterministic, in the docs/reference/logs.md schema, realistic in shape."""
from __future__ import annotations

import gzip
import json

import numpy as np
import pandas as pd

from bench.lib.sample_logs import DEFAULT_OUT, TENANTS, SampleSpec, _corpus, generate, hourly_rates, write
from forecasting.ingest.logs import read_logs


def test_same_seed_same_bytes_and_the_bundled_file_is_what_the_script_makes(tmp_path) -> None:
    a = write(generate(), tmp_path / "a.jsonl.gz").read_bytes()
    b = write(generate(), tmp_path / "b.jsonl.gz").read_bytes()
    assert a == b
    assert DEFAULT_OUT.read_bytes() == a  # regenerate with: python -m bench.lib.sample_logs
    assert DEFAULT_OUT.stat().st_size < 2_000_000
    other = generate(SampleSpec(seed=8))
    assert [r["prompt"] for r in other[:50]] != [json.loads(x)["prompt"] for x in gzip.decompress(a).splitlines()[:50]]


def test_rows_follow_the_log_schema_and_the_servegen_rates(tmp_path) -> None:
    rows = generate(SampleSpec(days=3, requests=1500))
    path = write(rows, tmp_path / "logs.jsonl")
    log = read_logs(path)
    assert log.report.rows_quarantined == 0 and log.report.rows_used == len(rows)
    r = log.requests
    assert set(r["tenant"]) == set(TENANTS)
    assert 1200 < len(r) < 1800
    assert (r["timestamp"].max() - r["timestamp"].min()) > pd.Timedelta(days=2, hours=12)
    corpus = _corpus()
    for tenant, (_, rows_idx, _) in TENANTS.items():
        prompts = r.loc[r["tenant"] == tenant, "prompt"]
        systems = [corpus[i] for i in rows_idx]
        share = prompts.map(lambda p: any(p.startswith(s) for s in systems)).mean()
        assert 0.8 < share < 0.97  # about 10% noise prompts
        # hourly counts follow the client's ServeGen rates (correlated, not equal: Poisson draws)
        hours = ((r.loc[r["tenant"] == tenant, "timestamp"] - SampleSpec().start) // pd.Timedelta(hours=1)).to_numpy()
        counts = np.bincount(hours, minlength=72)
        assert len(counts) == 72
        assert np.corrcoef(counts, hourly_rates(3)[tenant])[0, 1] > 0.8
