"""A bench run's record: its last-line JSON object, saved with where and how it was made.

Every script in ``bench/`` prints one JSON object as its last line, on stdout, and nothing
after it on stdout or stderr, so that ``bench/x.py 2>&1 | tail -1 | jq`` reads its figures:
:meth:`Run.finish` prints it, and a bench calls it last. It also writes that object to
``bench/results/<bench>[-<variant>].json`` with the command line, the commit (and whether
the tree held other changes), the date, the duration, the machine and how loaded it was
(the 1-minute load average sampled through the run, and the run's niceness), so that
``bench/report.py`` can build docs/benchmarks.md from the saved files alone. A full run
has no variant; a quick or partial run, or one on a GPU, names its variant so that it
never overwrites the full run's file.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
#: Seconds between two samples of the load average while a bench runs.
LOAD_EVERY_S = 10


def add_results_option(parser: argparse.ArgumentParser) -> None:
    """``--results DIR`` (where the record goes) and ``--variant NAME`` (overrides the script's own choice)."""
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="folder for <bench>[-<variant>].json (default bench/results)")
    parser.add_argument("--variant", default=None,
                        help="name this run's record <bench>-NAME.json (default: none for a full run, "
                             "'quick' for --quick, 'partial' for a subset, the GPU's name on a GPU)")


def result_path(results: Path, bench: str, variant: str | None) -> Path:
    """``results/<bench>.json``, or ``results/<bench>-<variant>.json``."""
    return Path(results) / (f"{bench}-{variant}.json" if variant else f"{bench}.json")


def gpu_variant(name: str) -> str:
    """A variant from a GPU's name: ``"NVIDIA H200"`` -> ``"h200"``."""
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w and w not in ("nvidia", "geforce", "tesla")]
    return "-".join(words) or "gpu"


def commit() -> tuple[str | None, bool | None]:
    """The short commit of the checkout and whether anything but bench results differs from it.

    Returns ``(None, None)`` outside a git checkout. Changes under ``bench/results/`` and to
    docs/benchmarks.md do not count: one bench's record must not mark the next as dirty.
    """
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--", ".", ":!bench/results",
                                 ":!docs/benchmarks.md"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None, None
    return head, bool(status.strip())


def machine() -> dict:
    """CPU count, model and vector ISA, Python and torch versions, the GPU's name if torch sees one."""
    cpu_model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpus": os.cpu_count(), "cpu_model": cpu_model or platform.processor() or None,
            "python": platform.python_version(), "torch": None, "gpu": None}
    try:
        import torch

        info["torch"] = torch.__version__
        # the vector instructions torch's CPU kernels use: without AVX512-BF16, bf16 matmuls are far slower than fp32
        info["cpu_isa"] = torch.backends.cpu.get_cpu_capability()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def portable(obj, root: Path = ROOT):
    """``obj`` with this checkout's absolute paths made relative to it (``../x`` for its neighbours),
    so that a record says the same on every machine."""
    if isinstance(obj, dict):
        return {k: portable(v, root) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [portable(v, root) for v in obj]
    if isinstance(obj, str) and obj.startswith(str(root.parent) + os.sep):
        return os.path.relpath(obj, root)
    return obj


def without_results(argv: list[str]) -> list[str]:
    """``argv`` less ``--results DIR``: where a record was written is no part of how it was made."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--results":
            skip = True
        elif not arg.startswith("--results="):
            out.append(arg)
    return out


class Run:
    """One bench run, started when the script starts and written when it has its figures.

    Args:
        bench: the bench's name (``"store"``, ``"loader"``...): the record's file name.
        script: the script's ``__file__``, for the command line.
        argv: the arguments the script was given (``sys.argv[1:]`` when run as a script).
    """

    def __init__(self, bench: str, script: str, argv: list[str]) -> None:
        self.bench = bench
        self.command = shlex.join([f"bench/{Path(script).name}", *portable(without_results(argv))])
        self.head, self.dirty = commit()  # the code this run imports: the tree as it starts
        self.t0 = time.perf_counter()
        self.loadavg_start = os.getloadavg()[0]
        self.load_samples = [self.loadavg_start]
        self._done = threading.Event()
        threading.Thread(target=self._sample_load, name="bench-load", daemon=True).start()

    def _sample_load(self) -> None:
        # the machine is shared: one figure per LOAD_EVERY_S says how busy it was while the bench ran
        while not self._done.wait(LOAD_EVERY_S):
            self.load_samples.append(os.getloadavg()[0])

    def write(self, result: dict, results: Path, variant: str | None) -> Path:
        """Save ``result`` (the printed object) with its provenance; returns the file written."""
        self._done.set()
        samples = [*self.load_samples, os.getloadavg()[0]]
        record = {
            "bench": self.bench, "variant": variant, "command": self.command, "commit": self.head, "dirty": self.dirty,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "duration_s": round(time.perf_counter() - self.t0, 1),
            "loadavg": [round(self.loadavg_start, 2), round(samples[-1], 2)],
            "load": {"median": round(statistics.median(samples), 2), "max": round(max(samples), 2),
                     "samples": len(samples), "every_s": LOAD_EVERY_S, "nice": os.nice(0)},
            "machine": machine(), "result": portable(result),
        }
        path = result_path(results, self.bench, variant)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"result written to {portable(str(path.resolve()))}", flush=True)
        return path

    def finish(self, result: dict, results: Path, variant: str | None) -> Path:
        """Save ``result`` (:meth:`write`), then print it as the run's last line (:func:`last_line`).

        A bench calls it last, once whatever it started that could still print (a Prefect server,
        an engine) has stopped. Returns the file written.
        """
        path = self.write(result, results, variant)
        # stderr first: a warning still buffered there must not land after the result in `2>&1`
        sys.stderr.flush()
        print(last_line(result), flush=True)
        return path


def last_line(result: dict) -> str:
    """``result`` as a bench's last line: one JSON object on one line.

    Raises:
        TypeError: ``result`` is not a dict (the line must parse as a JSON object).
    """
    if not isinstance(result, dict):
        raise TypeError(f"a bench's last line is a JSON object, not {type(result).__name__}")
    return json.dumps(result)


def variant_of(args: argparse.Namespace, *, partial: bool = False, gpu: str | None = None) -> str | None:
    """The record's variant: ``--variant`` if given, else the GPU's name (``h200``) on a GPU,
    ``quick`` for ``--quick``, ``partial`` for a subset of the full run, none for the full run."""
    if args.variant:
        return args.variant
    parts = [gpu_variant(gpu)] if gpu else []
    if getattr(args, "quick", False):
        parts.append("quick")
    elif partial:
        parts.append("partial")
    return "-".join(parts) or None
