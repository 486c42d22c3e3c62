"""The write-back bench's parts that run without vLLM: its counters, store count, figures, targets and page."""
from __future__ import annotations

from pathlib import Path

from bench.lib.component_pages import PAGES
from bench.lib.writeback_store import StoreWatch, counters, kv_bytes_per_token, summarize, thin

REF = {"num_hidden_layers": 12, "num_key_value_heads": 4, "head_dim": 64, "hidden_size": 768,
       "num_attention_heads": 12}


def test_counters_take_each_keys_largest_figure_over_the_roles_and_only_numbers() -> None:
    stats = {"scheduler": {"written_back_blocks": 8, "lookups": 3, "note": "x", "flag": True},
             "worker": {"written_back_blocks": 10, "write_back_dropped:queue_full": 2}, "other": None}
    assert counters(stats) == {"written_back_blocks": 10, "lookups": 3, "write_back_dropped:queue_full": 2}


def test_the_engines_kv_bytes_per_token_are_layers_k_and_v_heads_and_dim() -> None:
    assert kv_bytes_per_token(REF, 2) == 12 * 2 * 4 * 64 * 2
    assert kv_bytes_per_token({**REF, "head_dim": None}, 1) == 12 * 2 * 4 * 64


def test_the_node_tier_count_is_the_tenants_snapshot_files_alone(tmp_path: Path) -> None:
    objects = tmp_path / "objects"
    for tenant, name, size in (("bench", "ab/ab1.kvw", 10), ("bench", "cd/cd2.kvw", 30), ("other", "ab/ab3.kvw", 5),
                               ("bench", "ab/ab4.tmp", 7)):
        path = objects / tenant / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * size)
    got = StoreWatch(tmp_path, "http://127.0.0.1:1", "bucket/kvwarm", "bench").nvme()
    assert (got["blocks"], got["bytes"], sorted(got["sizes"])) == (2, 40, [10, 30])


def test_thin_keeps_at_most_its_count_and_the_last_point() -> None:
    pts = list(range(1000))
    out = thin(pts, 60)
    assert len(out) == 60 and out[-1] == 999 and out[0] == 0
    assert thin(pts[:5], 60) == pts[:5]


def _run(*, dropped: int = 0, on_nvme: int = 8, in_s3: int = 8, s3_after: float | None = 3.0) -> dict:
    block = 1_000_000
    burst = {"start": 100.0, "end": 110.0, "seconds": 10.0, "requests": 2, "prompt_tokens": 2048,
             "counters": {"written_back_blocks": 6, "written_back_bytes": 6 * block, "written_back_uploads": 5}}
    final = {"written_back_blocks": on_nvme, "written_back_bytes": on_nvme * block, "written_back_uploads": in_s3}
    if dropped:
        final["write_back_dropped:queue_full"] = dropped
    samples = [{"t": 111.0, "counters": {"written_back_blocks": on_nvme, "written_back_uploads": 6}},
               {"t": 112.5, "counters": {"written_back_blocks": on_nvme, "written_back_uploads": in_s3}}]
    result = {"final_stats": {"worker": final}, "samples": samples}
    return summarize(burst=burst, result=result, expected=8,
                     nvme={"blocks": on_nvme, "bytes": on_nvme * block, "sizes": [block] * on_nvme},
                     s3={"blocks": in_s3, "bytes": in_s3 * block},
                     s3_done_at=None if s3_after is None else 110.0 + s3_after, listings=[[0.5, 5, 6]],
                     link={"bytes_per_s": 2 * block, "puts": 32, "object_bytes": block, "streams": 4},
                     geo=REF, prompt_blocks=4, slack=(1.5, 5.0))


def test_a_run_that_stored_every_block_in_time_meets_every_target() -> None:
    out = _run()
    t = out["targets"]
    assert all(v["met"] for v in t.values())
    assert out["s3"]["link_s"] == 4.0 and out["s3"]["limit_s"] == 11.0 and out["s3"]["after_burst_s"] == 3.0
    assert out["s3"]["after_burst_s_counters"] == 2.5
    rates = out["rates"]
    assert rates["prefill_tokens_per_s"] == 204.8
    assert rates["prefill_kv_mb_s"] == 204.8 * 12288 / 1e6
    assert rates["writeback_mb_s_burst"] == 0.6 and rates["last_write_after_burst_s"] == 1.0


def test_drops_missing_blocks_and_a_slow_s3_each_miss_their_target() -> None:
    t = _run(dropped=2, on_nvme=6, in_s3=6, s3_after=None)["targets"]
    assert not t["zero_dropped"]["met"] and t["zero_dropped"]["value"] == 2
    assert not t["every_full_block_on_nvme"]["met"]
    assert not t["s3_within_link_time"]["met"]
    assert not _run(s3_after=12.0)["targets"]["s3_within_link_time"]["met"]  # past 1.5 x 4 s + 5 s


def test_the_bench_page_section_shows_the_figures_and_verdicts() -> None:
    out = {**_run(dropped=2), "model": "kvwarm-ref", "prompt_tokens": 1024, "depth": 8}
    (table,) = PAGES["writeback"].tables(out)
    cells = [c for row in table.rows for c in row]
    assert "write_back:queue_full 2" in cells and "**not met**" in cells
    assert "≤ 11.0 s (1.5 x the link's 4.0 s + 5 s)" in cells
