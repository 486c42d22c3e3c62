"""A careless operator's configuration and store URLs (issue 31, point 6): each value that was
coerced or accepted is refused, with the key, what it takes and what to write instead."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefill.cli import main
from store.config import S3Config, StoreConfig, load_config, parse_config
from store.errors import ConfigError
from store.tiers.registry import tiers_from_url

TEXT = "You are a meticulous travel planner. Ask for dates, budget and interests before proposing anything."


def write(tmp_path: Path, name: str, text: str) -> Path:
    f = tmp_path / name
    f.write_text(text)
    return f


def test_attack_block_size_true_is_refused_not_read_as_1(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "k.yaml", "kv_cache:\n  block_size: true\n"))
    assert "kv_cache.block_size = True: expected an integer, got a boolean" in str(err.value)


def test_attack_nvme_cap_0_is_a_config_error_not_a_traceback(tmp_path: Path, capsys) -> None:
    cfg = write(tmp_path, "k.yaml", "store:\n  nvme_cap: 0\n")
    assert main(["store", "ls", "--tenant", "acme", "--config", str(cfg), "--store",
                 f"file://{tmp_path / 'store'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("prefill: error: ") and "store.nvme_cap = 0" in err and "greater than or equal to 1" in err


def test_attack_ttl_hours_inf_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "k.yaml", "kv_cache:\n  ttl_hours: .inf\n  ttl_max_hours: .inf\n"))
    msg = str(err.value)
    assert "kv_cache.ttl_hours = inf: expected a finite number" in msg and "kv_cache.ttl_max_hours = inf" in msg


def test_attack_keep_layers_minus_1_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "k.yaml", "kv_cache:\n  keep_layers: [-1, 0]\n"))
    assert "kv_cache.keep_layers = [-1, 0]: layer -1 is not a layer: layers count from 0" in str(err.value)


def test_attack_keep_layers_1e9_outside_the_model_is_refused_by_the_prefill_job(tmp_path: Path, capsys) -> None:
    # 1e9 as JSON writes it is a float: not a layer number at all
    with pytest.raises(ConfigError, match=r"kv_cache.keep_layers\[1\] = 1000000000.0: expected an integer"):
        load_config(write(tmp_path, "float.json", '{"kv_cache": {"keep_layers": [0, 1e9]}}'))
    # as an integer it is one, of a layer the model does not have: refused once the model is loaded
    cfg = write(tmp_path, "k.json", json.dumps({"kv_cache": {"keep_layers": [0, 10 ** 9]}}))
    rc = main(["warm", "--config", str(cfg), "--store", f"file://{tmp_path / 'store'}", "--block-size", "16",
               "--text", TEXT])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "kv_cache.keep_layers = [0, 1000000000]: layer 1000000000 is outside model 'kvwarm-tiny', which has " \
           "4 layers (0 to 3)" in err
    assert not list((tmp_path / "store").rglob("*.kvw"))  # nothing was written with the misread setting


def test_attack_file_relative_url_is_refused(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["store", "ls", "--tenant", "acme", "--store", "file://relative"]) == 2
    err = capsys.readouterr().err
    assert "'file://relative' names the relative path 'relative'" in err and "file:///absolute/path" in err
    assert not (tmp_path / "relative").exists()
    with pytest.raises(ConfigError, match="store.url = 'file://relative'"):
        parse_config({"store": {"url": "file://relative"}})


def test_attack_s3_bucket_dotdot_prefix_is_refused(tmp_path: Path) -> None:
    settings = StoreConfig(s3=S3Config(endpoint_url="http://127.0.0.1:9", op_timeout_s=1, retries=0))
    with pytest.raises(ConfigError) as err:
        tiers_from_url(f"file://{tmp_path / 'nvme'},s3://bucket/../x", settings)
    assert "has a '..' segment in its key prefix" in str(err.value) and "e.g. s3://bucket/x" in str(err.value)
    assert not (tmp_path / "nvme").exists()  # refused before any tier was made
    with pytest.raises(ConfigError, match=r"store.url = 's3://bucket/../x'"):
        parse_config({"store": {"url": "s3://bucket/../x"}})
