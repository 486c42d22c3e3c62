"""The audit on real stores: wrong KV under right keys is quarantined, and nothing else; order, filters, model, budget."""
from __future__ import annotations

import pytest

from prefill.audit import AuditModelMismatch, AuditOptions, audit
from store.identity.fingerprint import ModelIdentity
from store.tiers.maintenance import verify
from store.tiers.store import Store
from tests.prefill.audit_store import names, prefill_chain, present, put_chain, tokens
from tests.prefill.factories import config_for
from tests.store.tiers.mem_tier import MemTier

BLOCK = 16
OTHER = ModelIdentity("other-model@3", "tok-other")


@pytest.fixture()
def config():
    return config_for("fp8", BLOCK)


@pytest.fixture()
def mixed(tiny, store, config):
    """A store of every source, two write-back blocks wrong: (store, {label: object names}, wrong names)."""
    chains = {
        "prefill": prefill_chain(store, tiny, config, tokens(3, BLOCK, seed=1)),
        "wb": put_chain(store, tiny, config, tokens(3, BLOCK, seed=2), source="write-back",
                        wrong={1: "garbage_prefix"}),  # block 2 was computed from the right prefix: it is right
        "wb_first": put_chain(store, tiny, config, tokens(2, BLOCK, seed=3), source="write-back",
                              wrong={0: "another_block"}),
        "old": put_chain(store, tiny, config, tokens(2, BLOCK, seed=4), source=None),  # before headers said
    }
    by = {label: names(blocks) for label, blocks in chains.items()}
    return store, by, {by["wb"][1], by["wb_first"][0]}


def test_wrong_kv_under_right_keys_is_quarantined_and_nothing_else(tiny, mixed) -> None:
    store, by, wrong = mixed
    assert verify(store, quarantine=False).clean  # checksums, headers and keys are all right: only the numbers are not
    everything = present(store)
    report = audit(tiny, store, AuditOptions(sample=None))
    assert {where for where, _ in report.differences} == {store.tiers[0].describe(n) for n in wrong}
    assert present(store) == everything - wrong
    assert len(store.tiers[0].quarantined()) == 2 and len(report.quarantined) == 2
    counts = {s: (c.checked, c.agreed, c.differed, c.quarantined) for s, c in report.by_source.items()}
    assert counts == {"write-back": (5, 3, 2, 2), "unknown": (2, 2, 0, 0), "prefill": (3, 3, 0, 0)}
    assert all("KV differs from the model's recomputation: layer" in why for _, why in report.differences)
    assert not report.clean and report.stopped is None
    assert report.forwards == 4  # one per chain, however many of its blocks are audited


def test_a_second_audit_finds_the_store_clean_and_skips_what_lost_its_prefix(tiny, mixed) -> None:
    store, by, _ = mixed
    audit(tiny, store, AuditOptions(sample=None))
    again = audit(tiny, store, AuditOptions(sample=None))
    assert again.clean and again.total().checked == 6
    assert again.skipped["no_prefix"] == 2  # the blocks after each quarantined one: their prefix is gone


def test_write_back_is_audited_first_then_unknown_then_prefill(tiny, mixed) -> None:
    store, _, _ = mixed
    first = audit(tiny, store, AuditOptions(sample=5, quarantine=False, seed=7))
    assert {s: c.checked for s, c in first.by_source.items()} == {"write-back": 5, "unknown": 0, "prefill": 0}
    assert first.skipped["not_sampled"] == 5
    more = audit(tiny, store, AuditOptions(sample=7, quarantine=False))
    assert {s: c.checked for s, c in more.by_source.items()} == {"write-back": 5, "unknown": 2, "prefill": 0}


@pytest.mark.parametrize("sources, checked", [(("prefill",), {"write-back": 0, "unknown": 0, "prefill": 3}),
                                              (("unknown",), {"write-back": 0, "unknown": 2, "prefill": 0})])
def test_only_the_sources_asked_for_are_audited(tiny, mixed, sources, checked) -> None:
    store, _, _ = mixed
    everything = present(store)
    report = audit(tiny, store, AuditOptions(sample=None, sources=sources))
    assert {s: c.checked for s, c in report.by_source.items()} == checked
    assert report.clean and present(store) == everything  # the wrong write-back blocks were not looked at


def test_the_blocks_after_one_that_differs_are_judged_too_sampled_or_not(tiny, store, config) -> None:
    """A prefill that continued from a wrong stored block computed its next block wrong: once the
    block is quarantined that one could not be recomputed, and would be served again when the block
    is stored again. So the audit judges every stored descendant of a block that differs."""
    ids = tokens(4, BLOCK, seed=11)
    chain = put_chain(store, tiny, config, ids, source="write-back", wrong={1: "garbage_prefix"}, only=[0, 1])
    put_chain(store, tiny, config, ids, source="prefill", wrong={2: "garbage_prefix"}, only=[2, 3])
    report = audit(tiny, store, AuditOptions(sample=None, sources=("write-back",)))
    assert report.descendants == 2 and report.forwards == 2
    assert {w for w, _ in report.differences} == {store.tiers[0].describe(n) for n in names(chain)[1:3]}
    assert present(store) == {names(chain)[0], names(chain)[3]}  # block 3 was computed from the right prefix
    assert report.by_source["prefill"].checked == 2 and report.by_source["prefill"].quarantined == 1


def test_descendants_the_budget_left_unjudged_are_quarantined_with_the_wrong_block(tiny, store, config) -> None:
    ids = tokens(3, BLOCK, seed=12)
    chain = put_chain(store, tiny, config, ids, source="write-back", wrong={1: "garbage_prefix"}, only=[0, 1])
    put_chain(store, tiny, config, ids, source="prefill", only=[2])
    report = audit(tiny, store, AuditOptions(sample=None, sources=("write-back",), budget_s=1e-9))
    assert report.stopped == "budget" and report.forwards == 1 and report.skipped["over_budget"] == 1
    assert present(store) == {names(chain)[0]}  # block 2 could never be recomputed once block 1 is gone
    reasons = dict(report.differences)
    assert reasons[store.tiers[0].describe(names(chain)[2])].startswith("not recomputed: its chain runs through")
    assert report.by_source["prefill"].checked == 0 and len(report.quarantined) == 2


def test_report_only_leaves_the_wrong_copies_in_place_but_says_so(tiny, mixed) -> None:
    store, _, wrong = mixed
    report = audit(tiny, store, AuditOptions(sample=None, quarantine=False))
    assert not report.clean and len(report.differences) == 2 and not report.quarantined
    assert wrong <= present(store)


def test_another_model_is_refused_naming_the_model_to_pass(tiny, store, config) -> None:
    put_chain(store, tiny, config, tokens(2, BLOCK, seed=5), source="write-back", identity=OTHER)
    with pytest.raises(AuditModelMismatch, match=r"made by other-model@3 \(2 snapshots\): pass --model the "
                                                 r"directory \(or hub id\) of that model"):
        audit(tiny, store, AuditOptions(sample=None))
    assert issubclass(AuditModelMismatch, ValueError)  # bad input: the CLI exits 2 with the message


def test_in_a_store_of_two_models_the_other_ones_snapshots_are_counted_and_left(tiny, store, config) -> None:
    put_chain(store, tiny, config, tokens(2, BLOCK, seed=5), source="write-back", identity=OTHER)
    put_chain(store, tiny, config, tokens(2, BLOCK, seed=6), source="write-back")
    report = audit(tiny, store, AuditOptions(sample=None))
    assert report.clean and report.total().checked == 2 and report.skipped["other_model"] == 2


def test_the_budget_stops_the_audit_between_forwards(tiny, mixed) -> None:
    store, _, _ = mixed
    report = audit(tiny, store, AuditOptions(sample=None, budget_s=1e-9, quarantine=False))
    assert report.stopped == "budget" and report.forwards == 1  # any forward spends more than a nanosecond
    assert report.total().checked + report.skipped["over_budget"] == 10


def test_chunked_forwards_judge_as_one_forward_does(tiny, store, config) -> None:
    put_chain(store, tiny, config, tokens(4, BLOCK, seed=8), source="write-back", wrong={3: "garbage_prefix"})
    report = audit(tiny, store, AuditOptions(sample=None, max_batch_tokens=BLOCK, quarantine=False))
    assert report.forwards == 1 and report.tokens == 4 * BLOCK
    assert report.by_source["write-back"].agreed == 3 and report.by_source["write-back"].differed == 1


def test_every_tiers_copy_is_judged_and_only_the_wrong_one_quarantined(tiny, config, tmp_path) -> None:
    local = Store.open(f"file://{tmp_path / 'nvme'}", config).tiers[0]
    mem = MemTier("mem://second")
    ids = tokens(2, BLOCK, seed=9)
    put_chain(Store([local]), tiny, config, ids, source="write-back")
    blocks = put_chain(Store([mem]), tiny, config, ids, source="write-back", wrong={1: "garbage_prefix"})
    store = Store([local, mem])
    report = audit(tiny, store, AuditOptions(sample=None))
    assert report.total().checked == 4 and [w for w, _ in report.differences] == [mem.describe(names(blocks)[1])]
    assert local.exists(names(blocks)[1]) and not mem.exists(names(blocks)[1]) and len(mem.quarantined()) == 1
    assert report.forwards == 1  # the KV is recomputed once for every copy


def test_bad_options_are_refused_before_any_work() -> None:
    for kw, message in ((dict(sample=0), "sample must be at least 1"), (dict(sources=("engine",)), "must be some of"),
                        (dict(tolerance=0.05), "must be a prefill.agreement.Tolerance"), (dict(budget_s=0.0), "budget_s 0.0")):
        with pytest.raises(ValueError, match=message):
            AuditOptions(**kw)
