"""Steady decodes told in bulk (:class:`Decodes`) leave the ledger exactly where the same requests told one
by one (after the step's other requests) leave the walking ledger, the specification.

Random steps as in ``test_validity_properties.py``, with most requests decoding a token at the end of
their context, and a small block pool so that decodes write blocks other tables hold, read blocks other
requests write, and hold invalid ones. Then the cases that must not be left to chance.
"""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from store.engines.vllm.decodes import Decodes, unsettled
from store.engines.vllm.validity import BlockLedger, Compute
from tests.store.engines.vllm.ledger_reference import ReferenceLedger

B = 4
BLOCKS = st.integers(0, 9)
REQS = ("a", "b", "c", "d", "e", "f")


def _step(data: st.DataObject, ref: ReferenceLedger, req: str) -> Compute:
    table = ref.tables.get(req) or []
    kind = data.draw(st.sampled_from(("new", "grow", "decode", "decode", "decode", "other", "ghost")))
    if kind == "new" or (kind != "ghost" and not table):
        blocks = data.draw(st.lists(BLOCKS, min_size=1, max_size=5))
        start = data.draw(st.integers(0, len(blocks) * B))
        return Compute(req, start, data.draw(st.integers(0, len(blocks) * B - start)), tuple(blocks), True)
    if kind == "ghost":  # rare in the engine: a table the ledger cannot follow
        return Compute(req, len(table) * B + data.draw(st.integers(-B, B)), data.draw(st.integers(1, B + 1)))
    if kind == "grow":
        new = tuple(data.draw(st.lists(BLOCKS, min_size=1, max_size=2)))
        start = data.draw(st.integers(0, len(table) * B))
        return Compute(req, start, data.draw(st.integers(0, (len(table) + len(new)) * B - start)), new)
    if kind == "decode":  # the next token, near the table's end (or a spec-decode's few, over a block's end)
        start = max(0, len(table) * B - data.draw(st.integers(1, 2 * B)))
        return Compute(req, start, data.draw(st.sampled_from((1, 1, 1, 2, 3))))
    start = data.draw(st.integers(0, len(table) * B))  # a rewind, a chunk, or nothing at all
    return Compute(req, start, data.draw(st.integers(0, len(table) * B - start)))


def _split(computes: list[Compute], data: st.DataObject) -> tuple[list[Compute], Decodes]:
    """Some of the requests that keep their tables go in bulk, the rest one by one."""
    bulk = [c for c in computes if not c.replace and not c.new_blocks and data.draw(st.booleans())]
    rest = [c for c in computes if c not in bulk]
    return rest, Decodes(tuple(c.req_id for c in bulk), tuple(c.start for c in bulk), tuple(c.tokens for c in bulk))


def _same(led: BlockLedger, ref: ReferenceLedger) -> None:
    assert led.blind == ref.blind and set(led.invalid) == ref.invalid and led.tables == ref.tables
    for req, table in ref.tables.items():
        for blocks in range(len(table) + 1):
            assert led.valid_prefix(req, blocks) == ref.valid_prefix(req, blocks), (req, blocks)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_decodes_in_bulk_answer_as_the_walking_ledger_after_every_step(data: st.DataObject) -> None:
    led, ref = BlockLedger(B), ReferenceLedger(B)
    one = BlockLedger(B)  # the same ledger told every request one by one: it visits as many blocks
    for _ in range(data.draw(st.integers(1, 10), label="steps")):
        for b in data.draw(st.lists(BLOCKS, max_size=1), label="marked bad by hand"):
            for x in (led, ref, one):
                x.invalid.add(b)
        ended = data.draw(st.lists(st.sampled_from(REQS), max_size=1, unique=True), label="ended")
        for req in ended:
            ref.tables.pop(req, None)
        reqs = data.draw(st.lists(st.sampled_from(REQS), max_size=6, unique=True), label="scheduled")
        rest, bulk = _split([_step(data, ref, req) for req in reqs], data)
        told = rest + [Compute(*c) for c in zip(*bulk)]
        led.begin(rest, decodes=bulk, ended=ended)
        ref.begin(told, ended=ended)
        one.begin(told, ended=ended)
        if data.draw(st.booleans()):  # a load, failing part-way, into some blocks
            ids = data.draw(st.lists(BLOCKS, max_size=3, unique=True))
            ok = data.draw(st.integers(0, len(ids)))
            for x in (led, ref, one):
                x.loaded(ids, ok)
        for x in (led, ref, one):
            x.computed()
        _same(led, ref)
        assert led.visited == one.visited


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_steps_of_decodes_only_over_a_few_shared_blocks_answer_as_the_walking_ledger(data: st.DataObject) -> None:
    tables = data.draw(st.dictionaries(st.sampled_from(REQS), st.lists(st.integers(0, 5), min_size=1, max_size=4)
                                       .map(tuple), min_size=1))
    led, ref = _decoding(tables)
    one, _ = _decoding(tables)
    for _ in range(data.draw(st.integers(1, 4), label="steps")):
        for b in data.draw(st.lists(st.integers(0, 5), max_size=1), label="marked bad by hand"):
            for x in (led, ref, one):
                x.invalid.add(b)
        told = []
        for req, table in tables.items():  # any span of its table: a decode, a spec-decode's few, a rewind
            start = data.draw(st.integers(0, len(table) * B - 1))
            told.append(Compute(req, start, data.draw(st.integers(1, min(3, len(table) * B - start)))))
        led.begin([], decodes=Decodes(*(tuple(col) for col in list(zip(*told))[:3])))
        ref.begin(told)
        one.begin(told)
        for x in (led, ref, one):
            x.computed()
        _same(led, ref)
        assert led.visited == one.visited


def _decoding(tables: dict[str, tuple[int, ...]]) -> tuple[BlockLedger, ReferenceLedger]:
    """Both ledgers after a step that gave ``tables``, each request having computed all but its last token."""
    led, ref = BlockLedger(B), ReferenceLedger(B)
    for x in (led, ref):
        x.begin([Compute(r, 0, len(t) * B - 1, t, True) for r, t in tables.items()])
        x.computed()
    return led, ref


def _decode(led: BlockLedger, ref: ReferenceLedger, rest: list[Compute], reqs: dict[str, int]) -> None:
    """One step: ``rest`` one by one, then ``reqs`` (request -> start) decoding a token each, in bulk."""
    bulk = Decodes(tuple(reqs), tuple(reqs.values()), (1,) * len(reqs))
    led.begin(rest, decodes=bulk)
    ref.begin(rest + [Compute(r, s, 1) for r, s in reqs.items()])


def test_a_decode_writing_a_block_another_request_just_took_as_a_prefix_hit_follows_that_request() -> None:
    led, ref = _decoding({"A": (1, 2), "Z": (9,)})
    # B is given A's tail block 2 (a prefix hit, async scheduling) and computes after it; A writes its last token
    # into block 2 over a context whose block 1 a failed load has just spoiled
    _decode(led, ref, [Compute("B", 2 * B, 2, (1, 2, 3), True)], {"A": 2 * B - 1, "Z": B - 1})
    assert unsettled(led._index, B, Decodes(("A", "Z"), (2 * B - 1, B - 1), (1, 1)), [("B", 2 * B, 2)]) == ([0], 1)
    for x in (led, ref):
        x.loaded((1,), 0)
        x.computed()
    _same(led, ref)
    assert led.valid_prefix("A", 2) == 0 and led.valid_prefix("B", 3) == 0 and led.valid_prefix("Z", 1) == 1


def test_a_decode_whose_tail_is_invalid_is_checked_and_its_write_stays_invalid() -> None:
    led, ref = _decoding({"A": (1, 2), "C": (5, 6)})
    for x in (led, ref):
        x.invalid.add(2)  # A's tail (its write starts inside it: the block's earlier tokens are bad)
    _decode(led, ref, [], {"A": 2 * B - 1, "C": 2 * B - 1})
    assert unsettled(led._index, B, Decodes(("A", "C"), (2 * B - 1, 2 * B - 1), (1, 1)), []) == ([0], 1)
    for x in (led, ref):
        x.computed()
    _same(led, ref)
    assert 2 in led.invalid and led.valid_prefix("A", 2) == 1 and led.valid_prefix("C", 2) == 2


def test_a_decode_past_its_table_or_of_a_table_never_seen_makes_the_ledger_blind() -> None:
    for reqs in ({"A": 2 * B, "C": 2 * B - 1}, {"ghost": 0, "C": 2 * B - 1}):
        led, ref = _decoding({"A": (1, 2), "C": (5, 6)})
        _decode(led, ref, [], reqs)
        for x in (led, ref):
            x.computed()
        _same(led, ref)
        assert led.blind and led.valid_prefix("C", 2) == 0


def test_a_decode_reading_a_block_another_request_recomputes_follows_that_request() -> None:
    led, ref = _decoding({"A": (1, 2), "C": (1, 6)})
    for x in (led, ref):
        x.invalid.add(1)
    # A recomputes block 1 over nothing bad; C, decoding, attends to it: C's write is valid with A's
    _decode(led, ref, [Compute("A", 0, 2 * B - 1)], {"C": 2 * B - 1})
    assert unsettled(led._index, B, Decodes(("C",), (2 * B - 1,), (1,)), [("A", 0, 2 * B - 1)]) == ([0], 0)
    for x in (led, ref):
        x.computed()
    _same(led, ref)
    assert not led.invalid and led.valid_prefix("C", 2) == 2


def test_clean_decodes_are_settled_in_bulk_and_counted_as_the_exact_rule_counts_them() -> None:
    tables = {f"r{i}": (2 * i, 2 * i + 1) for i in range(50)}
    led, _ = _decoding(tables)
    before = led.visited
    bulk = Decodes(tuple(tables), (2 * B - 1,) * 50, (1,) * 50)
    assert unsettled(led._index, B, bulk, []) == ([], 50)
    led.begin([], decodes=bulk)
    led.computed()
    assert led.visited - before == 50 and not led.invalid


def test_a_request_told_twice_leaves_every_decode_to_the_exact_rule() -> None:
    led, _ = _decoding({"A": (1, 2), "C": (5, 6)})
    assert unsettled(led._index, B, Decodes(("A", "C"), (7, 7), (1, 1)), [("A", 0, 1)]) == ([0, 1], 0)
    assert unsettled(led._index, B, Decodes(("C", "C"), (7, 7), (1, 1)), []) == ([0, 1], 0)


def test_a_decode_reading_what_a_decode_of_several_blocks_writes_follows_it() -> None:
    led, ref = _decoding({"A": (1, 2, 3), "C": (2, 6)})
    for x in (led, ref):
        x.invalid.add(1)  # A's context is bad: what it writes into blocks 2 and 3 is too
    # A (a rewind, in bulk) writes tokens B-1 .. B+1, over blocks 1 and 2; C, decoding, attends to block 2
    bulk = Decodes(("A", "C"), (B - 1, 2 * B - 1), (2, 1))
    assert unsettled(led._index, B, bulk, []) == ([0, 1], 0)
    led.begin([], decodes=bulk)
    ref.begin([Compute("A", B - 1, 2), Compute("C", 2 * B - 1, 1)])
    for x in (led, ref):
        x.computed()
    _same(led, ref)
    assert led.valid_prefix("C", 2) == 0 and 6 in led.invalid


def test_spec_decodes_within_their_block_are_settled_in_bulk_and_one_over_a_block_end_is_not() -> None:
    tables = {f"r{i}": (3 * i, 3 * i + 1, 3 * i + 2) for i in range(4)}
    led, ref = _decoding(tables)
    # three tokens each: r0 from inside block 1 to its end; r1 over block 1's end into block 2
    bulk = Decodes(tuple(tables), (B, 2 * B - 2, B + 1, 2 * B), (3, 3, 3, 3))
    assert unsettled(led._index, B, bulk, []) == ([1], 3)
    led.begin([], decodes=bulk)
    ref.begin([Compute(*c) for c in zip(*bulk)])
    for x in (led, ref):
        x.computed()
    _same(led, ref)
