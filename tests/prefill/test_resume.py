"""A prefill job killed mid-run leaves only whole snapshots, and a rerun finishes the rest."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from prefill.cli import main
from prefill.models import _corpus

ROOT = Path(__file__).resolve().parents[2]


def snapshot_files(store_dir: Path) -> list[Path]:
    return list((store_dir / "objects").rglob("*.kvw")) if (store_dir / "objects").exists() else []


def test_sigkill_mid_run_then_rerun_completes_without_recomputing_finished_blocks(tmp_path, capsys):
    texts = tmp_path / "prompts.txt"
    texts.write_text("\n".join(t.replace("\n", " ") for t in _corpus()[100:160]) + "\n")
    store_dir = tmp_path / "store"
    args = ["warm", "--store", f"file://{store_dir}", "--block-size", "16", "--file", str(texts),
            "--max-batch-tokens", "256", "--json"]
    # The job stops dead after its 20th snapshot (tests/prefill/paused_warm.py): killed
    # then, it is certainly mid-run, however fast or slow this machine is.
    paused, log = tmp_path / "paused", tmp_path / "job.log"
    with open(log, "wb") as out:  # a file, not a pipe: a full pipe would stall the job
        proc = subprocess.Popen([sys.executable, "-m", "tests.prefill.paused_warm", str(paused), "20", *args],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300  # a hang guard
        while not paused.exists():
            assert proc.poll() is None, f"the job ended before its 20th snapshot: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "the job wrote fewer than 20 snapshots in 300 s"
            time.sleep(0.05)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the job and nothing else
        except ProcessLookupError:
            pass  # it had ended (and the test failed above)
        proc.wait()
    killed_with = len(snapshot_files(store_dir))
    assert killed_with == 20

    # every file the killed run left is a whole, verified snapshot
    assert main(["store", "--store", f"file://{store_dir}", "verify"]) == 0
    capsys.readouterr()
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # A batch's blocks are written by a few threads, so the killed run may have left a block
    # after a gap: the rerun's probe counts only the leading blocks, recomputes from the gap
    # and finds the later block already there (skipped, not written twice).
    assert report["blocks_stored_before"] + report["blocks_skipped"] >= killed_with - 1
    assert report["blocks_left"] == 0
    assert report["blocks_written"] + report["blocks_stored_before"] + report["blocks_skipped"] == report["blocks_total"]
    assert main(["store", "--store", f"file://{store_dir}", "verify"]) == 0
