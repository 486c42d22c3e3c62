"""The incremental block-validity ledger answers exactly as the walking one did, and its work per step
does not grow with context.

The oracle is the ledger as it was before it became incremental (``ledger_reference.py``). Random
steps drive both: tables given, grown, replaced and ended; blocks shared between requests and
copied; loads that fail part-way; requests that read blocks other requests write in the same step,
in chains and in cycles, from inside a block; steps the scheduler could not describe; blocks marked
bad by hand. After every step every question the worker can ask gets the same answer from both.
"""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from store.engines.vllm.validity import BlockLedger, Compute
from tests.store.engines.vllm.ledger_reference import ReferenceLedger

B = 4
#: A small pool of block ids, so that tables share blocks and steps write each other's context.
BLOCKS = st.integers(0, 11)
REQS = ("a", "b", "c", "d", "e")


def _table(ref: ReferenceLedger, req: str) -> list[int]:
    return ref.tables.get(req) or []


def _compute(data: st.DataObject, ref: ReferenceLedger, req: str) -> Compute:
    """One request's part of a step: usually a table the ledger can follow, now and then one it cannot."""
    kind = data.draw(st.sampled_from(("new", "grow", "grow", "grow", "same")))
    if data.draw(st.integers(0, 60)) == 30:  # (not an end: Hypothesis favours those)
        kind = "ghost"  # rare: from then on the ledger is blind, and every answer is 0
    table = _table(ref, req)
    if kind == "new" or (kind != "ghost" and not table):
        blocks = data.draw(st.lists(BLOCKS, min_size=1, max_size=6))
        start = data.draw(st.integers(0, len(blocks) * B))
        tokens = data.draw(st.integers(0, len(blocks) * B - start))
        return Compute(req, start, tokens, tuple(blocks), replace=True)
    if kind == "ghost":  # tokens past the table's end: the ledger cannot tell which blocks were written
        return Compute(req, len(table) * B, B + 1)
    new = tuple(data.draw(st.lists(BLOCKS, max_size=2))) if kind == "grow" else ()
    size = (len(table) + len(new)) * B
    start = data.draw(st.integers(0, size))  # a rewind, a chunk, a decode, or nothing at all
    tokens = data.draw(st.integers(0, size - start))
    return Compute(req, start, tokens, new)


def _same_answers(led: BlockLedger, ref: ReferenceLedger, data: st.DataObject) -> None:
    assert led.blind == ref.blind
    assert set(led.invalid) == ref.invalid
    assert led.tables == ref.tables
    for req in REQS + ("ghost",):
        assert led.table(req) == ref.table(req)
        table = _table(ref, req)
        for blocks in range(-2, len(table) + 3):
            assert led.valid_prefix(req, blocks) == ref.valid_prefix(req, blocks), (req, blocks)
        for ratio in (1, 2):
            for first in range(len(table) // ratio + 1):
                ids = tuple(table[first * ratio :])
                assert led.vouched(req, first, ids, ratio) == ref.vouched(req, first, ids, ratio)
                ids = ids[: data.draw(st.integers(0, len(ids)))]
                assert led.vouched(req, first, ids, ratio) == ref.vouched(req, first, ids, ratio)
        bogus = tuple(data.draw(st.lists(BLOCKS, max_size=4)))
        assert led.vouched(req, 0, bogus, 1) == ref.vouched(req, 0, bogus, 1)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_incremental_ledger_answers_as_the_walking_one_after_every_step(data: st.DataObject) -> None:
    led, ref = BlockLedger(B), ReferenceLedger(B)
    for _ in range(data.draw(st.integers(1, 12), label="steps")):
        for b in data.draw(st.lists(BLOCKS, max_size=2), label="marked bad by hand"):
            led.invalid.add(b)
            ref.invalid.add(b)
        ended = data.draw(st.lists(st.sampled_from(REQS), max_size=2, unique=True), label="ended")
        copies = data.draw(st.lists(st.tuples(BLOCKS, BLOCKS), max_size=2), label="copies")
        if data.draw(st.integers(0, 40)) == 20:
            computes = None  # the scheduler could not say what the step computes
        else:
            reqs = data.draw(st.lists(st.sampled_from(REQS), max_size=4, unique=True), label="scheduled")
            # the tables as they will be after this step's ends, so that grown tables are sized right
            for req in ended:
                ref.tables.pop(req, None)
            computes = [_compute(data, ref, req) for req in reqs]
        led.begin(computes, copies=copies, ended=ended)
        ref.begin(computes, copies=copies, ended=ended)
        for c in computes or ():
            table = _table(ref, c.req_id)
            if table and data.draw(st.integers(0, 2)) == 0:  # a load into the blocks before its start
                ids = table[: min(len(table), c.start // B)]
                ok = data.draw(st.integers(0, len(ids)))
                led.loaded(ids, ok)
                ref.loaded(ids, ok)
        led.computed()
        ref.computed()
        _same_answers(led, ref, data)


def test_cycles_chains_and_writes_from_inside_a_block_agree_with_the_walking_ledger() -> None:
    # the cases the property test must not leave to chance: A and B read each other's writes (a
    # cycle); C reads B's; D reads A's write of block 5 that starts inside it; E reads nobody's
    for bad in (set(), {1}, {5}, {1, 2, 5}):
        led, ref = BlockLedger(B), ReferenceLedger(B)
        for x in (led, ref):
            x.invalid |= bad
            x.begin([Compute("A", 4, 4, (1, 2), replace=True), Compute("B", 4, 4, (2, 1), replace=True),
                     Compute("C", 8, 4, (1, 2, 7), replace=True), Compute("A2", 6, 6, (9, 5, 6), replace=True),
                     Compute("D", 8, 4, (9, 5, 8), replace=True), Compute("E", 4, 4, (9, 3), replace=True)])
            x.computed()
        _same_answers_plain(led, ref)


def _same_answers_plain(led: BlockLedger, ref: ReferenceLedger) -> None:
    assert set(led.invalid) == ref.invalid and led.blind == ref.blind
    for req in ref.tables:
        for blocks in range(len(ref.tables[req]) + 1):
            assert led.valid_prefix(req, blocks) == ref.valid_prefix(req, blocks), (req, blocks)


def _decode_steps(context_tokens: int, *, requests: int = 32, steps: int = 40) -> int:
    """Block entries the ledger touches over ``steps`` decode steps of ``requests`` requests at ``context_tokens``,
    with a prefill chunk of a new request, a failed load, and a save each step: the same shape at any context."""
    eb = 16
    led = BlockLedger(eb)
    per = context_tokens // eb
    tables = {f"r{i}": list(range(i * 10_000, i * 10_000 + per)) for i in range(requests)}
    led.begin([Compute(r, context_tokens - 1, 1, tuple(t), replace=True) for r, t in tables.items()])
    led.loaded(tables["r0"][:per // 2], ok=per // 4)  # r0's context holds invalid blocks from here on
    led.computed()
    before = led.visited
    done = {r: context_tokens for r in tables}
    for step in range(steps):
        computes = []
        for r, table in tables.items():
            new = ()
            if done[r] % eb == 0:
                new = (10_000_000 + step * 1000 + int(r[1:]),)
                table.append(new[0])
            computes.append(Compute(r, done[r], 1, new))
            done[r] += 1
        chunk = tuple(range(20_000_000 + step * 100, 20_000_000 + step * 100 + 8))  # 128 tokens, 8 blocks
        computes.append(Compute(f"new{step}", 0, 8 * eb, chunk, replace=True))
        led.begin(computes, ended=[f"new{step - 1}"] if step else [])
        led.computed()
        assert led.vouched(f"new{step}", 0, chunk, 1) == 8
        assert led.valid_prefix("r0", len(tables["r0"])) == per // 4
        assert led.valid_prefix("r1", len(tables["r1"])) == len(tables["r1"])
    return led.visited - before


def test_the_work_of_a_step_does_not_grow_with_context_length() -> None:
    short, long = _decode_steps(2048), _decode_steps(8192)
    assert short == long
    # and it is what the steps schedule: a block per decode, the chunk's blocks as it is given, written, dropped
    assert long < 40 * (32 + 3 * 8 + 8) + 32 * 8
