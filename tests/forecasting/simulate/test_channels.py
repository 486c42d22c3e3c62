"""Copies from S3 as the replay models them: channels first come first served, over one shared link."""
from __future__ import annotations

from forecasting.simulate.channels import FetchChannel, S3Link
from forecasting.simulate.tiers import NodeTier


def test_copies_land_first_come_first_served_and_skip_what_the_tier_has() -> None:
    channel, tier = FetchChannel(2.0), NodeTier(10)
    assert channel.submit([1, 2, 3], now=0.0) == 3 and channel.submit([2], now=0.5) == 0  # queued once
    tier.put([2], [(0.0, 1.0)])  # 2 arrives another way (written back) before its turn
    assert channel.landed(1.9, tier) == []
    assert channel.landed(2.0, tier) == [1]
    assert channel.landed(4.0, tier) == [3]  # 2 was skipped at no cost
    assert channel.pending == set() and channel.copied == 2


def test_two_channels_over_one_link_copy_no_faster_together_than_the_link() -> None:
    link = S3Link(1.0)
    fast, other = FetchChannel(0.25, link), FetchChannel(0.25, link)
    fast.submit([1, 2], now=0.0)
    other.submit([3, 4], now=0.0)
    got = fast.landed(2.0, set()) + other.landed(2.0, set())
    assert got == [1, 2]  # the link carried two blocks by 2 s; the other channel waits for it
    assert other.landed(4.0, set()) == [3, 4]


def test_a_channel_alone_runs_at_its_own_rate_under_a_faster_link() -> None:
    channel = FetchChannel(1.0, S3Link(0.1))
    channel.submit([1, 2, 3], now=0.0)
    assert channel.landed(2.0, set()) == [1, 2]


def test_a_copied_channel_draws_on_the_link_it_is_given() -> None:
    link = S3Link(1.0)
    channel = FetchChannel(0.5, link)
    channel.submit([1], now=0.0)
    assert channel.landed(1.0, set()) == [1] and link.busy_until == 1.0
    twin_link = link.copy()
    twin = channel.copy(twin_link)
    twin.submit([2], now=1.0)
    assert twin.landed(2.0, set()) == [2] and twin_link.busy_until == 2.0 and link.busy_until == 1.0
