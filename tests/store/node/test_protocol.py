"""The node's frames and bodies, and the hello's checks: pure, no process."""
from __future__ import annotations

import socket

import pytest

from store.config import parse_config
from store.errors import ConfigError, NodeRefused
from store.node.handshake import Handshake, default_socket, socket_path, store_settings
from store.node.protocol import (
    MAX_FRAME,
    Op,
    ProtocolError,
    decode_count,
    decode_keys,
    decode_paths,
    encode_count,
    encode_keys,
    encode_paths,
    recv_frame,
    send_frame,
)

KEYS = ["ab" * 32, "0f" * 32, "e1" * 32]


def test_keys_paths_and_counts_round_trip():
    assert decode_keys(encode_keys("acme", KEYS)) == decode_keys(encode_keys("acme", tuple(KEYS)))
    got = decode_keys(encode_keys("acme", KEYS))
    assert (got.namespace, got.keys) == ("acme", tuple(KEYS))
    assert len(encode_keys("acme", KEYS)) == 6 + 4 + 32 * 3  # fixed width: 32 raw bytes a key
    paths = ["/var/cache/kvwarm/objects/acme/ab/" + KEYS[0] + ".kvw", "/ü/x"]
    assert decode_paths(encode_paths(paths)) == paths and decode_paths(encode_paths([])) == []
    assert decode_count(encode_count(7)) == 7


@pytest.mark.parametrize("namespace, keys", [("acme", ["ab" * 31]), ("acme", ["zz" * 32]), ("Not A Tenant", KEYS[:1])])
def test_bad_keys_and_namespaces_are_refused(namespace, keys):
    with pytest.raises(ValueError):
        encode_keys(namespace, keys)


def test_truncated_or_padded_bodies_are_protocol_errors():
    body = encode_keys("acme", KEYS)
    for bad in (body[:-1], body + b"\0", body[:3]):
        with pytest.raises(ProtocolError):
            decode_keys(bad)
    with pytest.raises(ProtocolError):
        decode_paths(encode_paths(["/a/b"])[:-1])


def test_frames_cross_a_socket_and_an_oversized_one_is_refused():
    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        send_frame(a, Op.LOOKUP, encode_keys("acme", KEYS))
        op, body = recv_frame(b)
        assert op == Op.LOOKUP and decode_keys(body).keys == tuple(KEYS)
        send_frame(a, Op.STATS)
        assert recv_frame(b) == (Op.STATS, b"")
        a.sendall((MAX_FRAME + 1).to_bytes(4, "little") + bytes([Op.LOOKUP]))
        with pytest.raises(ProtocolError):
            recv_frame(b)
        a.close()
        with pytest.raises(ConnectionResetError):
            recv_frame(b)


def test_a_hello_names_each_setting_that_differs_and_the_versions():
    node = Handshake.of(parse_config({"store": {"url": "file:///a"}}), version="1.0")
    same = Handshake.decode(Handshake.of(parse_config({"store": {"url": "file:///a"}}), version="1.0").encode())
    node.check(same, where="/s")
    assert same.fingerprint == node.fingerprint
    with pytest.raises(NodeRefused, match=r"runs kvwarm 1\.0, this process kvwarm 2\.0"):
        node.check(Handshake.of(parse_config({"store": {"url": "file:///a"}}), version="2.0"), where="/s")
    other = Handshake.of(parse_config({"store": {"url": "file:///b"}, "kv_cache": {"keep_layers": []}}), version="1.0")
    with pytest.raises(NodeRefused) as refused:
        node.check(other, where="/s")
    msg = str(refused.value)
    assert "store.url = 'file:///b' here vs 'file:///a' in the node" in msg
    assert "kv_cache.precision" in msg and "block_size" not in msg
    assert other.fingerprint != node.fingerprint
    # tenants' secrets and loader knobs are no part of it: they may differ per engine
    tuned = parse_config({"store": {"url": "file:///a"}, "loader": {"fetch_workers": 7}})
    assert store_settings(tuned) == node.settings


def test_the_socket_path_defaults_and_its_length_is_checked(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert default_socket() == socket_path(parse_config({})) == socket_path(parse_config({})).parent / "node.sock"
    assert str(default_socket()) == "/run/user/1000/kvwarm/node.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setenv("KVWARM_HOME", str(tmp_path))
    assert default_socket() == tmp_path / "node.sock"
    assert socket_path(parse_config({"node": {"socket": "/run/k.sock"}})) == socket_path(parse_config({}), "/run/k.sock")
    with pytest.raises(ConfigError, match="at most 100 bytes"):
        socket_path(parse_config({"node": {"socket": "/" + "x" * 120}}))
