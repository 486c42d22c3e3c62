"""Fixtures of the tier tests: every registered tier, built from its URL through the registry.

``tier_case`` is parametrized over the local tier, the toy in-memory tier
(:mod:`tests.store.tiers.mem_tier`, registered for the test with one line), the S3
tier against moto (fast, in-process; ``moto_endpoint`` in tests/store/conftest.py) and the S3 tier against the session's real
SeaweedFS server (marked ``s3``). Tests that take it run once per tier.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pytest

from store.config import S3Config, StoreConfig
from store.tiers import registry
from store.tiers.base import Tier
from store.tiers.registry import tier_class, tiers_from_url

MEM_TIER = "tests.store.tiers.mem_tier:MemTier"
MOTO_BUCKET = "kvwarm-contract"


@dataclass(frozen=True)
class TierCase:
    """A tier under test, and how to read back what its quarantine kept."""

    tier: Tier
    evidence: Callable[[str], bytes]


@pytest.fixture
def mem_registered(monkeypatch) -> None:
    """The toy tier's one registry line."""
    monkeypatch.setitem(registry.TIERS, "mem", MEM_TIER)


def _s3fs(endpoint: str):
    import s3fs

    return s3fs.S3FileSystem(key="test", secret="test", client_kwargs={"endpoint_url": endpoint},
                             skip_instance_cache=True, use_listings_cache=False)


@pytest.fixture(params=["nvme", "mem", "s3-moto", pytest.param("s3-seaweedfs", marks=pytest.mark.s3)])
def tier_case(request, tmp_path: Path) -> Iterator[TierCase]:
    if request.param == "nvme":
        (tier,) = tiers_from_url(f"file://{tmp_path}/nvme", StoreConfig(nvme_cap=64 << 20, recency_flush_s=0))
        case = TierCase(tier, lambda where: Path(where).read_bytes())
    elif request.param == "mem":
        request.getfixturevalue("mem_registered")
        (tier,) = tiers_from_url("mem://contract")
        case = TierCase(tier, tier.evidence)  # type: ignore[attr-defined]
    else:
        creds = request.getfixturevalue("s3_credentials")
        if request.param == "s3-moto":
            endpoint = request.getfixturevalue("moto_endpoint")
            cfg = S3Config(endpoint_url=endpoint, op_timeout_s=10, connect_timeout_s=2, read_timeout_s=8,
                           retries=1, **creds)
            url = f"s3://{MOTO_BUCKET}/t-{uuid.uuid4().hex[:16]}"
        else:
            cfg, url = request.getfixturevalue("s3_config"), request.getfixturevalue("s3_url")
        tier = tier_class(url).from_url(url, StoreConfig(s3=cfg), create_bucket=True)
        raw = _s3fs(cfg.endpoint_url or "")
        case = TierCase(tier, raw.cat)
    yield case
    case.tier.close()
