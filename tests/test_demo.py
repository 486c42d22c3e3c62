"""``make demo`` today: write FP8 snapshots from a real (tiny) model and warm-start from them."""
from __future__ import annotations

from pathlib import Path

from prefill.demo import run


def test_demo_warm_start_matches_cold_prefill(tmp_path: Path, capsys) -> None:
    url = f"file://{tmp_path / 'store'}"
    first = run(url)
    assert first["blocks"] == 6 and first["top1_agrees"] == 1.0
    assert first["rel_logprob_change"] < 1e-2  # FP8 KV: small, nonzero change in next-token log-probs
    assert first["rel_logprob_change"] > 0
    out = capsys.readouterr().out
    assert "wrote 6 new snapshot(s)" in out
    again = run(url)  # idempotent: nothing rewritten, same answer
    assert "wrote 0 new snapshot(s)" in capsys.readouterr().out
    assert again == first
