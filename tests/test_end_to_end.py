"""Prefill with the ``prefill`` CLI, then serve from a fresh process through the loader.

Done-when 1 of the loader issue: the warm generation equals the cold one when the KV is
stored losslessly, and agrees within the prefill issue's FP8 tolerance otherwise.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prefill.cli import main as prefill_main
from prefill.models import HELD_OUT_PROMPTS, _corpus, load_model, resolve
from tests.prefill.factories import FP8_TARGET

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 16


def serve(tmp_path: Path, compression: str, dtype: str, texts: list[str]) -> dict:
    cfg = tmp_path / f"{compression}.yaml"
    cfg.write_text(f"kv_cache:\n  compression: {compression}\n  block_size: {BLOCK}\n"
                   f"tenants:\n  acme:\n    secret_env: E2E_ACME_SECRET\n")
    url = f"file://{tmp_path / ('store-' + compression)}"
    env_secret = {"E2E_ACME_SECRET": "e2e-secret-0123456789"}
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(texts) + "\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("E2E_ACME_SECRET", env_secret["E2E_ACME_SECRET"])
        rc = prefill_main(["warm", "--model", "kvwarm-tiny", "--store", url, "--config", str(cfg), "--tenant", "acme",
                           "--file", str(prompts_file), "--dtype", dtype, "--device", "cpu"])
    assert rc == 0
    loaded = load_model("kvwarm-tiny", dtype=dtype, device="cpu")
    # each request: the warmed prefix plus a question the store has never seen
    prompts = [loaded.encode(t) + loaded.encode(" Please answer briefly.") for t in texts]
    proc = subprocess.run([sys.executable, "-m", "tests.e2e_serving", url, str(cfg), str(resolve("kvwarm-tiny")), dtype,
                           json.dumps(prompts)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env_secret})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def texts():
    # prompts the default model was not trained on (prefill/training.py holds them out)
    return [t.replace("\n", " ")[:400] for t in _corpus()[HELD_OUT_PROMPTS - 12:HELD_OUT_PROMPTS]]


def test_lossless_snapshots_serve_the_cold_tokens(tmp_path, texts):
    out = serve(tmp_path, "fp32", "fp32", texts)
    assert out["hits"] == len(texts)
    for r in out["results"]:
        assert r["hit_tokens"] >= BLOCK
        assert r["warm"] == r["cold"]


def test_bf16_snapshots_of_a_bf16_model(tmp_path, texts):
    out = serve(tmp_path, "bf16", "bf16", texts)
    assert out["hits"] == len(texts)
    # the same greedy tokens (the trained default model: 50 of 50 held-out prompts exact; with
    # random weights, CPU bf16 rounding of a prefix computed alone flipped near-tied logits)
    for r in out["results"]:
        assert r["warm"] == r["cold"]


def test_fp8_snapshots_agree_within_the_prefill_tolerance(tmp_path, texts):
    out = serve(tmp_path, "fp8", "fp32", texts)
    assert out["hits"] == len(texts)
    same = sum(a == b for r in out["results"] for a, b in zip(r["warm"], r["cold"]))
    assert same / (20 * len(texts)) >= FP8_TARGET  # the default: FP8 with layer 0 kept in bf16
