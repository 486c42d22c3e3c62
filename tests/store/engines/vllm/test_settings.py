"""The connector's extra config: every key checked, every error naming the key and what to do."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from store.engines.vllm.settings import (
    ConnectorConfigError,
    check_block_sizes,
    loads_layer_by_layer,
    model_identities,
    parse_settings,
    resolve_model_dir,
)


@pytest.fixture()
def model_dir(tmp_path: Path, monkeypatch) -> Path:
    """A directory that looks like a saved model: config, weights, tokenizer, a chat template."""
    monkeypatch.setenv("KVWARM_HOME", str(tmp_path / "home"))  # fingerprints cached there
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"\0" * 64)
    (d / "tokenizer.json").write_text("{}")
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    return d


def test_defaults(model_dir: Path, monkeypatch) -> None:
    monkeypatch.delenv("KVWARM_CONFIG", raising=False)
    s = parse_settings(None, served_model=str(model_dir))
    assert (s.tenant, s.write_back, s.plan, s.prefill_tokens_per_s) == ("public", True, None, None)
    assert s.store_url == s.config.store.url and s.model_dir == model_dir


def test_every_key(model_dir: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "kvwarm.yaml"
    cfg.write_text("kv_cache:\n  block_size: 128\n")
    plan = tmp_path / "plan.json"
    plan.write_text("[]")
    s = parse_settings({"store": "file:///tmp/kv,s3://b/p", "tenant": "acme", "config": str(cfg),
                        "model": str(model_dir), "write_back": False, "plan": str(plan),
                        "prefill_tokens_per_s": 1500}, served_model="served-name")
    assert (s.store_url, s.tenant, s.write_back, s.plan) == ("file:///tmp/kv,s3://b/p", "acme", False, str(plan))
    assert s.config.kv_cache.block_size == 128 and s.prefill_tokens_per_s == 1500.0
    assert parse_settings({"plan": "latest"}, served_model=str(model_dir)).plan == "latest"


def test_load_mode_follows_vllms_async_scheduling_unless_set(model_dir: Path) -> None:
    auto = parse_settings(None, served_model=str(model_dir))
    assert auto.load_mode == "auto" and auto.async_loads(True) and not auto.async_loads(False)
    for mode, want in (("sync", False), ("async", True)):
        s = parse_settings({"load_mode": mode}, served_model=str(model_dir))
        assert s.async_loads(True) == want and s.async_loads(False) == want and s.loads
    off = parse_settings({"load_mode": "off"}, served_model=str(model_dir))
    assert not off.loads and not off.async_loads(True)


@pytest.mark.parametrize("extra, layered", [
    (None, True), ({}, True), ({"load_mode": "sync"}, True), ({"load_mode": "async"}, True),
    ({"load_mode": "auto", "write_back": False}, True), ({"load_mode": "off"}, False),
    ({"load_mode": "eager"}, True),  # refused at start; piecewise graphs are the safe answer meanwhile
])
def test_loads_are_layer_by_layer_unless_load_mode_is_off(extra, layered) -> None:
    assert loads_layer_by_layer(extra) is layered


@pytest.mark.parametrize("extra, must_say", [
    ({"stroe": "file:///x"}, ["unknown kv_connector_extra_config key(s) ['stroe']", "'store'"]),
    ({"store": ""}, ["kv_connector_extra_config.store", "store URL"]),
    ({"store": "http://x"}, ["kv_connector_extra_config.store", "'http://x'", "file://"]),
    ({"tenant": "Acme Corp"}, ["kv_connector_extra_config.tenant", "'Acme Corp'", "a-z"]),
    ({"write_back": "yes"}, ["kv_connector_extra_config.write_back", "true or false", "'yes'"]),
    ({"plan": "/nonexistent/plan.json"}, ["kv_connector_extra_config.plan", "does not exist", "'latest'"]),
    ({"prefill_tokens_per_s": 0}, ["kv_connector_extra_config.prefill_tokens_per_s", "positive"]),
    ({"prefill_tokens_per_s": True}, ["kv_connector_extra_config.prefill_tokens_per_s"]),
    ({"load_mode": "eager"}, ["kv_connector_extra_config.load_mode", "'auto'", "'eager'"]),
    ({"config": "/nonexistent/kvwarm.yaml"}, ["kv_connector_extra_config.config", "does not exist"]),
    ({"model": "/nonexistent/model"}, ["kv_connector_extra_config.model", "'/nonexistent/model'",
                                       "prefill warm --model"]),
])
def test_bad_values_name_the_key(extra: dict, must_say: list[str], model_dir: Path) -> None:
    with pytest.raises(ConnectorConfigError) as err:
        parse_settings(extra, served_model=str(model_dir))
    for fragment in must_say:
        assert fragment in str(err.value)


def test_a_bad_config_file_names_the_key_and_the_config_key(model_dir: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "kvwarm.json"
    cfg.write_text(json.dumps({"kv_cache": {"compression": "fp4"}}))
    with pytest.raises(ConnectorConfigError, match=r"(?s)kv_connector_extra_config\.config.*kv_cache\.compression"):
        parse_settings({"config": str(cfg)}, served_model=str(model_dir))


def test_a_tenant_whose_secret_is_unset_fails_at_start(model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    cfg = tmp_path / "kvwarm.yaml"
    cfg.write_text("tenants:\n  acme:\n    secret_env: ACME_SECRET_FOR_TEST\n")
    monkeypatch.delenv("ACME_SECRET_FOR_TEST", raising=False)
    with pytest.raises(ConnectorConfigError, match=r"\.tenant: .*ACME_SECRET_FOR_TEST is not set"):
        parse_settings({"config": str(cfg), "tenant": "acme"}, served_model=str(model_dir))


def test_the_served_model_is_the_default_and_its_error_says_so() -> None:
    with pytest.raises(ConnectorConfigError, match=r"\.model \(default: the model vLLM serves\)"):
        parse_settings({}, served_model="/nonexistent/served")


def test_a_hub_snapshot_in_the_local_cache_is_found(tmp_path: Path, monkeypatch) -> None:
    snap = tmp_path / "hub" / "models--org--m" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (tmp_path / "hub" / "models--org--m" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--m" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model_dir("org/m") == snap


def test_identities_plain_and_chat(model_dir: Path) -> None:
    plain, chat = model_identities(model_dir)
    assert plain.chat_template_hash == "" and chat is not None and chat.chat_template_hash
    assert chat.model_fingerprint == plain.model_fingerprint
    (model_dir / "tokenizer_config.json").write_text("{}")
    assert model_identities(model_dir)[1] is None


def test_identities_of_a_directory_without_tokenizer_name_the_model_key(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"x")
    with pytest.raises(ConnectorConfigError, match=r"\.model: no tokenizer files"):
        model_identities(d)


def test_block_sizes() -> None:
    assert check_block_sizes(256, 128) == 2 and check_block_sizes(256, 16) == 16 and check_block_sizes(128, 128) == 1
    with pytest.raises(ConnectorConfigError, match=r"block_size \(256\) must be a multiple of vLLM's block size \(96\)"):
        check_block_sizes(256, 96)
    with pytest.raises(ConnectorConfigError, match="--block-size"):
        check_block_sizes(128, 256)
