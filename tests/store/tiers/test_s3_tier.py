"""What is particular to S3Tier, against a real SeaweedFS S3 server: the Tier contract it shares
with every tier is tests/store/tiers/test_tier_contract.py (there on SeaweedFS and on moto)."""
from __future__ import annotations

import pytest

from store.config import S3Config
from store.errors import ConfigError
from store.format.encode import snapshot_bytes
from store.tiers.base import object_name
from store.tiers.s3 import S3Tier
from tests.store.factories import ACME, make_chain, make_root, make_snapshot

pytestmark = pytest.mark.s3


@pytest.fixture
def tier(s3_url, s3_config) -> S3Tier:
    return S3Tier(s3_url, s3_config, create_bucket=True)


def acme_chain(n: int = 4):
    root = make_root(ACME)
    chain = make_chain(root, n)
    return root, chain, [object_name(ACME.name, b.key) for b in chain]


def test_a_second_tier_on_the_same_url_sees_the_objects(tier, s3_config):
    root, chain, names = acme_chain(1)
    raw = snapshot_bytes(make_snapshot(root, chain[0]))
    tier.write(names[0], raw, expires_at=0)
    other = S3Tier(tier.url, s3_config)
    assert other.read(names[0]).to_pybytes() == raw


@pytest.mark.parametrize(
    "url, words",
    [
        ("http://bucket/prefix", ["not an S3 URL", "s3://bucket"]),
        ("s3://", ["not an S3 URL"]),
        ("file:///tmp/x", ["not an S3 URL"]),
        ("s3://ab/prefix", ["'ab'", "at least 3 characters"]),
    ],
)
def test_bad_url_is_a_config_error(url, words):
    with pytest.raises(ConfigError) as err:
        S3Tier(url, S3Config(endpoint_url="http://127.0.0.1:9"))
    msg = str(err.value)
    assert "store.url" in msg
    for w in words:
        assert w in msg


def test_missing_credential_env_vars_are_a_config_error(monkeypatch):
    monkeypatch.delenv("KVWARM_NO_SUCH_KEY", raising=False)
    monkeypatch.setenv("KVWARM_SOME_SECRET", "x")
    cfg = S3Config(endpoint_url="http://127.0.0.1:9", access_key_env="KVWARM_NO_SUCH_KEY",
                   secret_key_env="KVWARM_SOME_SECRET")
    with pytest.raises(ConfigError, match=r"\$KVWARM_NO_SUCH_KEY"):
        S3Tier("s3://bucket/prefix", cfg)


def test_a_call_on_the_io_thread_runs_on_s3fs_loop_thread_not_the_callers(tier):
    import threading
    ran = threading.Event()
    where: list[str] = []

    def probe() -> None:
        where.append(threading.current_thread().name)
        ran.set()

    assert tier.call_on_io_thread(probe) is True
    assert ran.wait(10)
    assert where == ["fsspecIO"] and threading.current_thread().name != "fsspecIO"
