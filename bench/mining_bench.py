"""Mining throughput: Mooncake block ids (blocks/s) and text logs (mining vs tokenisation alone).

1. The Mooncake conversation trace (12k requests, 288k blocks of 512 tokens, chained
   hash ids): the prefix tree, candidates (k >= 2), per-bucket counts and prefix ids,
   in blocks mined per second. Target: 1M blocks/s on 2 cores.
2. A text log made from the CC0 prompts (per-tenant system prompts + user text):
   ``mine_text`` (tokenise, block-align, chain-hash, count) plus ``build_demand``
   against the tokenizer alone on the same prompts in the same batches. Target:
   mining at most 1.5x tokenisation. The tokenizer is a byte-level BPE trained here on
   the same prompts (no model hub on these machines), wrapped in transformers'
   PreTrainedTokenizerFast as a real model's would be. Mining includes its own
   tokenisation, so the ratio is at least 1: the rest is block-aligning, chain-hashing
   and counting.

Each figure is the median of ``--repeats`` runs. The last line is one JSON object, also
written to ``bench/results/mining.json`` (``mining-quick.json`` for --quick).

    .venv/bin/python bench/mining_bench.py [--quick] [--data ../shared/data]
"""
from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.lib.results import Run, add_results_option, variant_of  # noqa: E402
from bench.lib.timing import timed_median  # noqa: E402
from forecasting.ingest.traces import read_mooncake  # noqa: E402
from forecasting.mining.demand import build_demand  # noqa: E402
from forecasting.mining.families import find_families  # noqa: E402
from forecasting.mining.prefix_tree import bucket_counts, candidates, mine_text, mine_trace  # noqa: E402
from store.format.precision import Precision  # noqa: E402
from store.identity.keys import KeyRoot  # noqa: E402
from store.identity.tenant import Tenant  # noqa: E402

BLOCKS_PER_S_TARGET = 1_000_000
RATIO_TARGET = 1.5


def mooncake(data: Path, repeats: int) -> dict:
    path = data / "traces" / "mooncake" / "conversation_trace.jsonl"
    t = time.perf_counter()
    trace = read_mooncake(path)
    read_s = time.perf_counter() - t
    hour_us = 3_600_000_000

    def mine():
        tree = mine_trace(trace)
        nodes = candidates(tree, k=2)
        start = int(tree.times_us.min()) // hour_us * hour_us
        n = int((tree.times_us.max() - start) // hour_us) + 1
        per_node, _ = bucket_counts(tree, nodes, hour_us, start, n)
        keys = tree.node_keys(nodes)
        return tree, nodes, keys, per_node

    mine()  # warm caches and imports
    secs, (tree, nodes, keys, _) = timed_median(mine, repeats)
    rate = tree.n_blocks / secs
    print(f"mooncake: {len(trace)} requests, {tree.n_blocks} blocks, {tree.n_nodes} prefix nodes, "
          f"{len(nodes)} candidates (k=2); read {read_s:.2f} s (not counted)")
    print(f"mooncake: mined in {secs * 1e3:.1f} ms (median of {repeats}) = {rate / 1e6:.2f} M blocks/s "
          f"(target {BLOCKS_PER_S_TARGET / 1e6:.0f} M) {'MET' if rate >= BLOCKS_PER_S_TARGET else 'MISSED'}")
    return {"requests": len(trace), "blocks": int(tree.n_blocks), "nodes": int(tree.n_nodes),
            "candidates": int(len(nodes)), "read_s": round(read_s, 3), "mine_s": round(secs, 4),
            "blocks_per_s": round(rate), "target_blocks_per_s": BLOCKS_PER_S_TARGET,
            "met": bool(rate >= BLOCKS_PER_S_TARGET)}


def _prompts(data: Path) -> list[str]:
    csv.field_size_limit(1 << 24)  # a few prompts are very long
    with (data / "prompts" / "awesome-chatgpt-prompts.csv").open(newline="", encoding="utf-8") as fh:
        return [row["prompt"] for row in csv.DictReader(fh) if row["prompt"].strip()]


def _tokenizer(corpus: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def text_log(prompts: list[str], n_requests: int, *, tenants: int = 8, systems_per_tenant: int = 5,
             seed: int = 0) -> pd.DataFrame:
    """Requests over one day: a tenant's system prompt (a CC0 prompt) + user text (a slice of another)."""
    rng = np.random.default_rng(seed)
    names = [f"tenant-{i}" for i in range(tenants)]
    # System prompts of ordinary length (a few CC0 prompts are whole programs of 100k characters).
    usual = [i for i, p in enumerate(prompts) if len(p) <= 3000]
    systems = np.asarray(usual)[rng.choice(len(usual), size=(tenants, systems_per_tenant), replace=False)]
    rows = []
    for i in range(n_requests):
        t = int(rng.integers(tenants))
        system = prompts[int(systems[t, rng.integers(systems_per_tenant)])]
        words = prompts[int(rng.integers(len(prompts)))].split()
        lo = int(rng.integers(max(1, len(words) - 40)))
        user = " ".join(words[lo:lo + int(rng.integers(10, 40))])
        rows.append((int(rng.integers(86_400_000_000)), names[t], system + "\n\nUser: " + user))
    times, tenant, prompt = zip(*sorted(rows))
    return pd.DataFrame({"timestamp": pd.to_datetime(np.asarray(times), unit="us").astype("datetime64[us]"),
                         "tenant": list(tenant), "model": "bench", "prompt": list(prompt), "token_ids": None})


def text(data: Path, repeats: int, n_requests: int, block_size: int, batch_size: int) -> dict:
    prompts = _prompts(data)
    tok = _tokenizer(prompts, 8000)
    log = text_log(prompts, n_requests)
    precision = Precision()
    roots = {t: KeyRoot("bench-model", "bench-tok", precision.kv_dtype, precision.scheme_id(), block_size,
                        Tenant.derive(t, "bench").salt) for t in sorted(set(log["tenant"]))}
    texts = list(log["prompt"])

    def tokenise():
        n = 0
        for lo in range(0, len(texts), batch_size):
            n += sum(len(x) for x in tok(texts[lo:lo + batch_size], add_special_tokens=False)["input_ids"])
        return n

    def mine():
        tree = mine_text(log, tok, roots, batch_size=batch_size)
        return tree, build_demand(tree, k=3)

    tokenise(), mine()  # warm up
    # Side by side: each repeat times both, back to back, so both see the same machine load.
    tok_times, mine_times = [], []
    for _ in range(repeats):
        t_tok, n_tokens = timed_median(tokenise, 1)
        t_mine, (tree, demand) = timed_median(mine, 1)
        tok_times.append(t_tok)
        mine_times.append(t_mine)
    tok_s, mine_s = statistics.median(tok_times), statistics.median(mine_times)
    ratio = statistics.median(m / t for m, t in zip(mine_times, tok_times))
    fam_s, fams = timed_median(lambda: find_families(tree), max(1, repeats // 2))
    print(f"text: {len(log)} requests, {n_tokens} tokens, {tree.n_blocks} blocks of {block_size}, "
          f"{len(demand.prefixes)} candidate prefixes, {len(fams.table)} families")
    print(f"text: tokenise alone {tok_s:.3f} s ({n_tokens / tok_s / 1e6:.2f} M tokens/s); mine + demand "
          f"{mine_s:.3f} s; median ratio of {repeats} paired runs {ratio:.2f}x (target <= {RATIO_TARGET}x) {'MET' if ratio <= RATIO_TARGET else 'MISSED'}")
    print(f"text: families (MinHash 128 perms + LSH 0.85, not in the ratio) {fam_s:.3f} s "
          f"({len(log) / fam_s:.0f} requests/s)")
    return {"requests": len(log), "tokens": int(n_tokens), "blocks": int(tree.n_blocks), "block_size": block_size,
            "candidates": int(len(demand.prefixes)), "families": int(len(fams.table)),
            "tokenise_s": round(tok_s, 4), "mine_s": round(mine_s, 4), "ratio": round(ratio, 3),
            "target_ratio": RATIO_TARGET, "met": bool(ratio <= RATIO_TARGET), "families_s": round(fam_s, 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data", help="shared data folder")
    ap.add_argument("--quick", action="store_true", help="a fast smoke run (fewer requests and repeats)")
    ap.add_argument("--repeats", type=int, default=None, help="runs per figure (median); default 3, quick 2")
    ap.add_argument("--requests", type=int, default=None, help="text-log requests; default 10000, quick 2000")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per block for text logs (vLLM's default)")
    ap.add_argument("--batch-size", type=int, default=1024, help="prompts per tokenizer call")
    add_results_option(ap)
    args = ap.parse_args(argv)
    run = Run("mining", __file__, sys.argv[1:] if argv is None else argv)
    repeats = args.repeats or (2 if args.quick else 3)
    n_requests = args.requests or (2000 if args.quick else 10000)
    result = {"bench": "mining", "quick": args.quick, "repeats": repeats,
              "mooncake": mooncake(args.data, repeats),
              "text": text(args.data, repeats, n_requests, args.block_size, args.batch_size)}
    result["met"] = result["mooncake"]["met"] and result["text"]["met"]
    run.finish(result, args.results, variant_of(args, partial=args.requests not in (None, 10000) or args.block_size != 16))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
