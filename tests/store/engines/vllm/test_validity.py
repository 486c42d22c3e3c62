"""The block-validity ledger: which engine blocks hold their tokens' KV, across requests and steps.

Engine blocks of 4 tokens here. Each case is one way vLLM can hand a request KV that nobody
wrote: another request's failed load in the same step, a chunk scheduled before the failure of
its own load is known (async scheduling), a copy of a bad block; and the ways blocks become
good again (a recompute, a successful load).
"""
from __future__ import annotations

from store.engines.vllm.validity import BlockLedger, Compute

B = 4


def ledger() -> BlockLedger:
    return BlockLedger(B)


def new(req: str, table, start: int, tokens: int) -> Compute:
    return Compute(req, start, tokens, tuple(table), replace=True)


def test_a_failed_load_poisons_what_another_request_computes_over_it_in_the_same_step() -> None:
    led = ledger()
    # A loads blocks 10, 11 (tokens 0..8) and computes 2 more; B got 10, 11 from vLLM's prefix cache
    led.begin([new("A", (10, 11, 12), 8, 2), new("B", (10, 11, 20, 21), 8, 8)])
    led.loaded((10, 11), ok=1)  # block 11 failed
    led.computed()
    assert led.valid_prefix("A", 3) == 1 and led.valid_prefix("B", 4) == 1
    assert {11, 12, 20, 21} <= led.invalid


def test_a_good_load_lets_every_sharer_store_its_blocks() -> None:
    led = ledger()
    led.begin([new("A", (10, 11, 12), 8, 2), new("B", (10, 11, 20, 21), 8, 8)])
    led.loaded((10, 11), ok=2)
    led.computed()
    assert led.valid_prefix("A", 3) == 3 and led.valid_prefix("B", 4) == 4 and not led.invalid


def test_the_next_chunk_scheduled_before_the_failure_is_known_is_poisoned_too() -> None:
    led = ledger()
    led.begin([new("A", (10, 11, 12, 13, 14), 8, 4)])  # step 1: load 0..8 (fails at block 11), chunk 8..12
    led.loaded((10, 11), ok=1)
    led.computed()
    # step 2 (async scheduling: planned before step 1's failure reached the scheduler): chunk 12..20
    led.begin([Compute("A", 12, 8)])
    led.computed()
    assert led.valid_prefix("A", 5) == 1
    # vLLM rewinds A to block 11 and recomputes from there: everything is good again
    led.begin([Compute("A", 4, 16)])
    led.computed()
    assert led.valid_prefix("A", 5) == 5 and not led.invalid


def test_a_block_another_request_recomputes_in_the_same_step_is_valid_for_its_readers() -> None:
    led = ledger()
    led.invalid.add(11)
    # A recomputes block 11 from its start while B, sharing it, computes after it (vLLM writes each layer's KV
    # of every scheduled token before that layer's attention reads it)
    led.begin([new("A", (10, 11, 12), 4, 6), new("B", (10, 11, 20), 8, 4)])
    led.computed()
    assert led.valid_prefix("B", 3) == 3 and not led.invalid


def test_a_recompute_that_itself_reads_a_bad_block_makes_its_readers_bad() -> None:
    led = ledger()
    led.invalid |= {10, 11}
    led.begin([new("A", (10, 11, 12), 4, 6), new("B", (10, 11, 20), 8, 4)])  # A's context (block 10) is bad
    led.computed()
    assert led.valid_prefix("B", 3) == 0 and {10, 11, 12, 20} <= led.invalid


def test_a_write_from_inside_a_block_keeps_the_tokens_before_it_as_they_were() -> None:
    led = ledger()
    led.begin([new("A", (10, 11), 0, 6)])  # tokens 0..6: block 11 half written
    led.loaded((), ok=0)
    led.computed()
    led.invalid.add(11)  # say its first half were bad
    led.begin([Compute("A", 6, 2)])  # the rest of block 11, over a context that includes its bad half
    led.computed()
    assert led.valid_prefix("A", 2) == 1


def test_copies_carry_validity_and_new_blocks_extend_a_table() -> None:
    led = ledger()
    led.invalid.add(5)
    led.begin([new("A", (1, 2), 0, 8)], copies=[(5, 7), (1, 9)])
    led.computed()
    assert 7 in led.invalid and 9 not in led.invalid
    led.begin([Compute("A", 8, 4, new_blocks=(3,))])
    led.computed()
    assert led.table("A") == [1, 2, 3] and led.valid_prefix("A", 3) == 3


def test_ended_requests_are_forgotten_and_a_resumed_one_gets_its_new_table() -> None:
    led = ledger()
    led.begin([new("A", (1, 2), 0, 8)])
    led.computed()
    led.begin([], ended=["A"])
    assert led.table("A") is None and led.valid_prefix("A", 2) == 0
    led.begin([Compute("A", 0, 8, new_blocks=(4, 5), replace=True)])
    led.computed()
    assert led.table("A") == [4, 5]


def test_a_request_the_ledger_never_saw_makes_it_blind() -> None:
    led = ledger()
    led.begin([new("A", (1, 2), 0, 8), Compute("ghost", 0, 4)])  # a table the worker was never told
    led.computed()
    assert led.blind and led.valid_prefix("A", 2) == 0
    other = ledger()
    other.begin(None)  # the scheduler could not say what the step computes
    assert other.blind


def test_requests_that_read_each_others_writes_in_one_step_are_not_trusted() -> None:
    led = ledger()
    led.begin([new("A", (1, 2), 4, 4), new("B", (2, 1), 4, 4)])  # impossible in vLLM: no order resolves it
    led.computed()
    assert led.valid_prefix("A", 2) == 0 and led.valid_prefix("B", 2) == 0
