"""Every bench's last line is its JSON object: on stdout, and on stdout and stderr together
(what ``bench/x.py 2>&1 | tail -1 | jq`` reads), with nothing after it."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.lib.results import ROOT

#: The cheapest runs of benches `make bench` runs, and keys their object holds. The prefill bench's
#: shard figure runs the pipeline's flows on a Prefect server (the one whose stop once logged a line
#: after the object).
CHEAP_RUNS = {
    "store": (["bench/store_bench.py", "--no-s3", "--no-cold", "--sizes", "1", "--reps", "1"],
              {"bench", "results", "checks"}),
    "prefill-shards": (["bench/prefill_bench.py", "--shards-only"], {"shards", "targets"}),
    # issue 32's component benches, each at a toy size (a few seconds; the ring's spawns its producer)
    "ledger": (["bench/ledger_bench.py", "--quick"], {"results", "targets"}),
    "writeback_encode": (["bench/writeback_encode_bench.py", "--layers", "2", "--blocks", "1", "--repeats", "1"],
                         {"old", "new", "speedup", "targets"}),
    "ring": (["bench/ring_bench.py", "--blocks", "4", "--ring-blocks", "2", "--repeats", "1"],
             {"ring_gb_s", "memcpy_gb_s", "targets"}),
    "node": (["bench/node_bench.py", "--blocks", "8", "--n", "50"], {"node_held_p50_us", "targets"}),
    "backlog": (["bench/backlog_bench.py", "--rows", "1000", "--reps", "20"], {"put_ms", "claim_ms", "targets"}),
}


def _make_bench_scripts() -> list[str]:
    recipe = (ROOT / "Makefile").read_text().split("\nbench:", 1)[1].split("\n\n", 1)[0]
    scripts = [m.group(1) for m in re.finditer(r"(bench/\w+_bench\.py)", recipe)]
    assert scripts, "no bench script in the Makefile's bench target"
    return scripts


def _last_line(run: subprocess.CompletedProcess[str]) -> dict:
    assert run.returncode == 0, run.stdout[-6000:]
    assert run.stdout.endswith("\n"), run.stdout[-2000:]
    line = run.stdout.splitlines()[-1]  # as `tail -1` takes it: a trailing blank line would be the last
    try:
        doc = json.loads(line)
    except ValueError:
        pytest.fail(f"the last line is not JSON: {line[:500]!r}\n...{run.stdout[-3000:]}")
    assert isinstance(doc, dict), line[:500]
    return doc


@pytest.mark.parametrize("name", sorted(CHEAP_RUNS))
def test_a_bench_ends_with_its_json_object_on_stdout_and_stderr_together(name: str, tmp_path: Path) -> None:
    argv, keys = CHEAP_RUNS[name]
    assert argv[0] in _make_bench_scripts()
    # one pipe for both streams, as `2>&1 |` makes it: a line on either after the object comes after it here
    run = subprocess.run([sys.executable, *argv, "--results", str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=900)
    doc = _last_line(run)
    assert keys <= set(doc), sorted(doc)
    (record,) = tmp_path.glob("*.json")
    assert set(json.loads(record.read_text())["result"]) == set(doc)


@pytest.mark.parametrize("script", _make_bench_scripts())
def test_every_bench_make_bench_runs_prints_its_object_through_run_finish(script: str) -> None:
    # the benches too long to run here: each ends through Run.finish, which prints the object last
    # (tests/bench/test_results.py), and none prints one of its own
    source = (ROOT / script).read_text()
    assert ".finish(" in source, script
    assert not re.search(r"print\(json\.dumps", source), script
