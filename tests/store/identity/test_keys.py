"""Key identity: golden values pin the encoding; every root field changes every key."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from store.identity.keys import (
    BlockKey,
    KeyRoot,
    block_chain,
    block_keys,
    chain_key,
    check_key,
    root_key,
    tokens_digest,
    tree_keys,
)
from store.identity.tenant import PUBLIC_TENANT, Tenant

REPO = Path(__file__).resolve().parents[3]
GOLDEN_ROOT = KeyRoot(
    "llama-3-8b@abc123", "tok@def456", "fp8_e4m3", "fp8_e4m3/scale=fp32:head/keep=:bf16", 16,
    bytes(range(32)), chat_template_hash="tmpl1", adapter_hash="", format_version=1,
)  # the version is explicit: these values pin the encoding, which a format change must not move


def test_golden_values_pin_the_encoding() -> None:
    assert root_key(GOLDEN_ROOT) == "b4b20c11da912c0cef1705b36bb0ccc750efce70a646ca282b018f55c2daffe3"
    assert block_keys(GOLDEN_ROOT, list(range(40))) == [
        "43f7449023286cea5e9f1ed6ce1e0174583f939af01fa5c75d236406cecbcc70",
        "bfc8c6fc782584d35fda94462cce153e24407c42f6d8839800a1a82f415495cf",
    ]


def test_block_key_is_documented_byte_encoding() -> None:
    parent = BlockKey("ab" * 32)
    expected = hashlib.sha256(
        b"kvwarm/block/v1\x00" + bytes.fromhex(parent) + struct.pack("<I", 3) + struct.pack("<3I", 7, 8, 2**32 - 1)
    ).hexdigest()
    assert chain_key(parent, [7, 8, 2**32 - 1]) == expected
    assert tokens_digest([7, 8]) == hashlib.sha256(struct.pack("<2I", 7, 8)).hexdigest()


def test_root_key_is_documented_byte_encoding() -> None:
    def field(v: str | bytes) -> bytes:
        raw = v.encode() if isinstance(v, str) else v
        return struct.pack("<I", len(raw)) + raw

    r = GOLDEN_ROOT
    body = struct.pack("<II", r.format_version, r.block_size) + b"".join(
        field(v) for v in (r.model_fingerprint, r.tokenizer_fingerprint, r.chat_template_hash, r.adapter_hash,
                           r.kv_dtype, r.quant_scheme, r.tenant_salt)
    )
    assert root_key(r) == hashlib.sha256(b"kvwarm/root/v1\x00" + body).hexdigest()


def test_keys_are_a_chain_and_partial_block_has_no_key() -> None:
    chain = block_chain(GOLDEN_ROOT, list(range(47)))
    assert len(chain) == 2  # 47 tokens = 2 full blocks of 16 + 15 left over
    assert chain[0].parent == root_key(GOLDEN_ROOT)
    assert chain[1].parent == chain[0].key
    assert chain[1].tokens == tuple(range(16, 32))
    assert block_chain(GOLDEN_ROOT, list(range(15))) == []


def test_numpy_and_list_tokens_give_the_same_keys() -> None:
    toks = list(range(100, 164))
    for dtype in (np.int32, np.int64, np.uint32):
        assert block_keys(GOLDEN_ROOT, np.array(toks, dtype=dtype)) == block_keys(GOLDEN_ROOT, toks)


def test_prefix_sharing_keys_agree_until_divergence() -> None:
    a = list(range(64))
    b = list(range(40)) + [999] * 24
    ka, kb = block_keys(GOLDEN_ROOT, a), block_keys(GOLDEN_ROOT, b)
    assert ka[:2] == kb[:2]  # blocks 0 and 1 (tokens 0..31) are shared
    assert ka[2] != kb[2] and ka[3] != kb[3]  # everything after the divergence differs


@pytest.mark.parametrize(
    "change",
    [
        {"model_fingerprint": "llama-3-8b@other"},
        {"tokenizer_fingerprint": "tok@other"},
        {"chat_template_hash": "tmpl2"},
        {"adapter_hash": "lora-1"},
        {"kv_dtype": "bf16"},
        {"quant_scheme": "fp8_e4m3/scale=fp32:head/keep=0:bf16"},
        {"block_size": 8},
        {"format_version": 2},
        {"tenant_salt": bytes(range(1, 33))},
    ],
    ids=lambda c: next(iter(c)),
)
def test_changing_any_root_input_changes_every_key(change: dict) -> None:
    tokens = list(range(64))
    other = dataclasses.replace(GOLDEN_ROOT, **change)
    base_keys = set(block_keys(GOLDEN_ROOT, tokens))
    other_keys = block_keys(other, tokens)
    assert other_keys, "the changed root must still produce keys"
    assert base_keys.isdisjoint(other_keys)
    assert root_key(other) != root_key(GOLDEN_ROOT)


def test_golden_tenant_salts_pin_the_derivation() -> None:
    """A secret tenant's salt is scrypt's (v2; its keys and salt_id changed with it), a no-secret
    tenant's and public's SHA-256 of the name (v1, unchanged): changing either moves every key."""
    assert Tenant.derive("acme", "correct-horse-battery-staple").salt.hex() == (
        "8857b5845d22dced674702db7f536de811a2df0e48689caab7a0640efb6cbf96")
    assert Tenant.derive("acme").salt.hex() == "48e3e6a405c32d19d5b0d2fcdfb9d6e8419696103fb9a3e4cd1fd0fbd336f3d8"
    assert PUBLIC_TENANT.salt.hex() == "1abb56a1343c6f4b7ae135209f8d2f25aa2f90e39e35e5df8bbc82e81fd23849"
    assert Tenant.derive("acme", b"correct-horse-battery-staple") == Tenant.derive("acme", "correct-horse-battery-staple")


def test_tenants_and_public_never_share_keys() -> None:
    a, b = Tenant.derive("acme", "s1"), Tenant.derive("bolt", "s2")
    same_name_other_secret = Tenant.derive("acme", "s3")
    roots = [dataclasses.replace(GOLDEN_ROOT, tenant_salt=t.salt) for t in (a, b, same_name_other_secret, PUBLIC_TENANT)]
    key_sets = [set(block_keys(r, list(range(64)))) for r in roots]
    for i in range(len(key_sets)):
        for j in range(i + 1, len(key_sets)):
            assert key_sets[i].isdisjoint(key_sets[j])


def test_keys_identical_across_processes_and_hash_seeds() -> None:
    # the child builds the root from its fields (a test module is not imported for its constants)
    code = (
        f"from store.identity.keys import KeyRoot, block_keys; root = KeyRoot(**{dataclasses.asdict(GOLDEN_ROOT)!r});"
        "print(','.join(block_keys(root, list(range(40)))))"
    )
    outs = set()
    for seed in ("0", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                                check=True).stdout.strip())
    assert outs == {",".join(block_keys(GOLDEN_ROOT, list(range(40))))}


def test_bad_inputs_are_refused_with_clear_errors() -> None:
    with pytest.raises(ValueError, match="token ids"):
        block_keys(GOLDEN_ROOT, [-1] * 16)
    with pytest.raises(ValueError, match="token ids"):
        block_keys(GOLDEN_ROOT, [2**32] * 16)
    with pytest.raises(ValueError, match="block_size"):
        dataclasses.replace(GOLDEN_ROOT, block_size=0)
    with pytest.raises(ValueError, match="tenant_salt"):
        dataclasses.replace(GOLDEN_ROOT, tenant_salt=b"short")
    with pytest.raises(ValueError, match="64 lower-case hex"):
        check_key("../../etc/passwd")
    assert check_key("a" * 64) == "a" * 64


def test_block_chain_keys_each_block_as_chain_key_does_and_refuses_bad_ids_anywhere() -> None:
    import numpy as np

    from store.format.precision import Precision
    from store.identity.fingerprint import ModelIdentity

    root = ModelIdentity("m@1", "t").key_root(Precision(), 4, b"s" * 32)
    ids = [7, 0, 2**32 - 1, 5, 9, 9, 9, 9, 1, 2]  # two full blocks of 4 and a partial one
    chain = block_chain(root, ids)
    assert [b.tokens for b in chain] == [(7, 0, 2**32 - 1, 5), (9, 9, 9, 9)]
    assert all(type(t) is int for b in chain for t in b.tokens)
    assert chain[0].key == chain_key(chain[0].parent, ids[:4]) and chain[1].key == chain_key(chain[0].key, ids[4:8])
    assert [b.key for b in block_chain(root, np.array(ids, dtype=np.int64))] == [b.key for b in chain]
    with pytest.raises(ValueError, match="token ids"):
        block_chain(root, ids[:8] + [-1])  # a bad id in the partial tail is still bad input
    with pytest.raises(ValueError, match="token ids"):
        block_chain(root, [-1])


def test_tree_keys_equal_keying_each_prefix() -> None:
    rng = np.random.default_rng(3)
    roots = [KeyRoot("m", "t", "fp8_e4m3", "s", 4, b"a" * 16), KeyRoot("m", "t", "fp8_e4m3", "s", 4, b"b" * 16)]
    # Two tenants' trees, parents numbered first: 0 <- 2 <- 4, 0 <- 3, and 1 <- 5 under the second root.
    parent = np.array([-1, -1, 0, 0, 2, 1])
    root_of = np.array([0, 1, 0, 0, 0, 1])
    blocks = rng.integers(0, 2**32, size=(6, 4), dtype=np.uint64)
    keys = tree_keys(parent, roots, root_of, blocks)
    for node, path in {4: [0, 2, 4], 3: [0, 3], 5: [1, 5]}.items():
        tokens = np.concatenate([blocks[i] for i in path])
        assert keys[node] == block_keys(roots[root_of[node]], tokens)[-1]
    assert keys[0] != keys[1]  # same position, other tenant's salt
    with pytest.raises(ValueError, match="parent numbered before"):
        tree_keys(np.array([1, -1]), roots, np.array([0, 0]), blocks[:2])
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        tree_keys(np.array([-1]), roots, np.array([0]), np.array([[-1, 0, 0, 0]]))
