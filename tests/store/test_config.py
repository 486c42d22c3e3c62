"""The configuration file: SageMaker write-up keys, defaults, and errors that say what to do."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from store.config import load_config, parse_config, with_values
from store.errors import ConfigError
from store.format.precision import Precision


def test_defaults_match_the_documented_policy() -> None:
    c = parse_config({})
    assert c.kv_cache.reuse_strategy == "exact_prefix"
    assert c.kv_cache.similarity_threshold == 0.85
    assert c.kv_cache.max_shared_instances == 8
    assert c.kv_cache.compression == "fp8"
    assert c.kv_cache.ttl_hours == 4.0 and (c.kv_cache.ttl_min_hours, c.kv_cache.ttl_max_hours) == (2.0, 6.0)
    assert c.kv_cache.precision() == Precision(keep_layers=(0,))  # mixed precision by default


def test_fleet_memory_defaults() -> None:
    fm = parse_config({}).fleet_memory
    assert (fm.enabled, fm.node_id, fm.window_s, fm.flush_s, fm.max_names) == (True, None, 3600.0, 30.0, 50_000)
    assert parse_config({"fleet_memory": {"node_id": "ip-10-0-0-7.ec2.internal"}}).fleet_memory.node_id


def test_accepts_the_sagemaker_inference_config_keys(tmp_path: Path) -> None:
    f = tmp_path / "inference-config.json"
    f.write_text(json.dumps({"kv_cache": {"reuse_strategy": "similarity", "similarity_threshold": 0.9,
                                          "max_shared_instances": 4, "compression": "bf16"}}))
    c = load_config(f)
    assert c.kv_cache.reuse_strategy == "similarity"
    assert c.kv_cache.precision().kv_dtype == "bf16"


def test_yaml_and_toml_files(tmp_path: Path) -> None:
    y = tmp_path / "k.yaml"
    y.write_text("kv_cache:\n  keep_layers: [0, 11]\nstore:\n  nvme_cap: 2GiB\n  url: file:///tmp/x\n")
    c = load_config(y)
    assert c.store.nvme_cap == 2 << 30 and c.kv_cache.precision().keep_layers == (0, 11)
    t = tmp_path / "k.toml"
    t.write_text('[kv_cache]\nttl_hours = 2.5\n')
    assert load_config(t).kv_cache.ttl_seconds() == 2.5 * 3600


@pytest.mark.parametrize(
    "data, must_say",
    [
        ({"kv_cache": {"compression": "fp4"}}, ["kv_cache.compression", "'fp4'", "'fp8', 'bf16', 'fp16' or 'fp32'"]),
        ({"kv_cache": {"reuse_strategy": "nearest"}}, ["kv_cache.reuse_strategy", "'nearest'", "exact_prefix"]),
        ({"kv_cache": {"similarity_threshold": 1.5}}, ["kv_cache.similarity_threshold", "1.5", "less than or equal to 1"]),
        ({"kv_cache": {"max_shared_instances": 0}}, ["kv_cache.max_shared_instances", "0", "greater than or equal to 1"]),
        ({"kv_cache": {"ttl_hours": 9}}, ["ttl_hours = 9", "[2.0, 6.0]"]),
        ({"kv_cache": {"compresion": "fp8"}}, ["kv_cache.compresion", "unknown key", "compression"]),
        ({"store": {"nvme_cap": "lots"}}, ["store.nvme_cap", "'lots'"]),
        ({"tenants": {"Bad Name": {}}}, ["'Bad Name'", "a-z, 0-9"]),
        ({"fleet_memory": {"window_s": 0}}, ["fleet_memory.window_s", "0", "greater than 0"]),
        ({"fleet_memory": {"flush_s": -1}}, ["fleet_memory.flush_s", "-1", "greater than 0"]),
        ({"fleet_memory": {"max_names": 0}}, ["fleet_memory.max_names", "0", "greater than or equal to 1"]),
        ({"fleet_memory": {"enabled": "maybe"}}, ["fleet_memory.enabled", "'maybe'", "boolean"]),
        ({"fleet_memory": {"node_id": "gpu node/1"}}, ["fleet_memory.node_id", "'gpu node/1'", "A-Z a-z 0-9 _ . -"]),
        ({"fleet_memory": {"window": 60}}, ["fleet_memory.window", "unknown key", "window_s"]),
    ],
)
def test_bad_values_name_key_value_and_what_is_allowed(data: dict, must_say: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    for fragment in must_say:
        assert fragment in str(err.value)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("kv_cache: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot be parsed"):
        load_config(bad)
    ext = tmp_path / "c.ini"
    ext.write_text("x")
    with pytest.raises(ConfigError, match="unknown extension"):
        load_config(ext)


def test_ttl_outside_policy_is_refused() -> None:
    c = parse_config({})
    assert c.kv_cache.ttl_seconds(6) == 6 * 3600
    with pytest.raises(ConfigError, match="policy bounds"):
        c.kv_cache.ttl_seconds(7)


def test_plan_ttls_are_clamped_into_the_policy_bounds() -> None:
    kv = parse_config({"kv_cache": {"ttl_min_hours": 1, "ttl_hours": 2, "ttl_max_hours": 3}}).kv_cache
    assert kv.clamp_ttl(None) == 2 * 3600.0  # no TTL asked for: the default one
    assert kv.clamp_ttl(0.0) == kv.clamp_ttl(60.0) == 3600.0
    assert kv.clamp_ttl(5400) == 5400.0
    assert kv.clamp_ttl(1e9) == kv.ttl_max_s == 3 * 3600.0


def test_tenant_secrets_come_from_named_env_vars() -> None:
    c = parse_config({"tenants": {"acme": {"secret_env": "ACME_SALT", "encryption_key_env": "ACME_KEY"}}})
    with pytest.raises(ConfigError, match=r"\$ACME_SALT is not set"):
        c.tenant("acme", environ={})
    with pytest.raises(ConfigError, match="64 hex characters"):
        c.tenant("acme", environ={"ACME_SALT": "s" * 16, "ACME_KEY": "zz"})
    with pytest.raises(ConfigError, match=r"tenants\.acme\.secret_env: the value of \$ACME_SALT has 15 characters"):
        c.tenant("acme", environ={"ACME_SALT": "s" * 15, "ACME_KEY": "00" * 32})  # 16 at least
    t = c.tenant("acme", environ={"ACME_SALT": "s" * 16, "ACME_KEY": "00" * 32})
    assert t.encryption_key == bytes(32)
    assert t.salt != c.tenant("acme", environ={"ACME_SALT": "other-secret-0123", "ACME_KEY": "00" * 32}).salt
    # An unconfigured tenant gets a name-derived salt (documented: isolation then rests on access checks).
    assert c.tenant("zeta").salt == c.tenant("zeta").salt


def test_loader_section_supplies_the_loader_defaults(tmp_path):
    from store.config import parse_config

    c = parse_config({"loader": {"pool_bytes": "2GiB", "fetch_mode": "sync", "sync_fetch_timeout_s": 0.5}})
    assert int(c.loader.pool_bytes) == 2 << 30 and c.loader.fetch_mode == "sync"
    assert parse_config(None).loader.fetch_mode == "background"
    with pytest.raises(ConfigError, match="loader.fetch_mode"):
        parse_config({"loader": {"fetch_mode": "eventually"}})


S_ACME, S_ACME_2, S_B = "s-acme-0123456789ab", "s-acme-2-0123456789ab", "s-b-0123456789abcd"


def test_cache_salts_name_one_tenant_each() -> None:
    c = parse_config({"tenants": {"acme": {"cache_salts": [S_ACME, S_ACME_2]}, "bolt": {"cache_salts": [S_B]}}})
    assert c.tenants["acme"].cache_salts == (S_ACME, S_ACME_2)
    assert c.salt_map({}) == {S_ACME: "acme", S_ACME_2: "acme", S_B: "bolt"}
    with pytest.raises(ConfigError, match=r"tenants.bolt.cache_salts: cache_salt #1 is already tenant 'acme'") as err:
        parse_config({"tenants": {"acme": {"cache_salts": [S_ACME]}, "bolt": {"cache_salts": [S_ACME]}}})
    assert S_ACME not in str(err.value)  # a salt is a secret: never in a message
    for key in ("cache_salts", "cache_salts_env", "cache_salts_file"):
        with pytest.raises(ConfigError, match="tenants.public cannot have cache_salts or cache_salts_env or"):
            parse_config({"tenants": {"public": {key: [S_B] if key == "cache_salts" else "X"}}})
    with pytest.raises(ConfigError, match="must not be empty"):
        parse_config({"tenants": {"acme": {"cache_salts": [""]}}})


def test_cache_salts_from_a_variable_and_a_file_merge_with_the_files_own(tmp_path) -> None:
    salts = tmp_path / "salts"
    salts.write_text(f"# comment\n\n  {S_ACME_2}\n{S_ACME}\n")
    c = parse_config({"tenants": {"acme": {"cache_salts": [S_ACME], "cache_salts_env": "ACME_SALTS",
                                           "cache_salts_file": str(salts)}}})
    assert c.cache_salts("acme", {"ACME_SALTS": f" {S_B} ,,"}) == (S_ACME, S_B, S_ACME_2)
    assert c.cache_salts("zeta", {}) == ()  # a tenant the config does not name has none
    for environ, must_say in (({}, r"\$ACME_SALTS is not set"), ({"ACME_SALTS": " , "}, "lists no cache_salt")):
        with pytest.raises(ConfigError, match=r"tenants\.acme\.cache_salts_env: .*" + must_say):
            c.cache_salts("acme", environ)
    salts.write_text("# none\n\n")
    with pytest.raises(ConfigError, match=r"tenants\.acme\.cache_salts_file: .* lists no cache_salt"):
        c.cache_salts("acme", {"ACME_SALTS": S_B})
    salts.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="not UTF-8"):
        c.cache_salts("acme", {"ACME_SALTS": S_B})


def test_trust_named_is_a_setting_of_the_tenants_section_and_no_tenant_may_take_the_name() -> None:
    assert parse_config({}).trust_named is False
    c = parse_config({"tenants": {"trust_named": True, "acme": {"cache_salts": [S_ACME]}}})
    assert c.trust_named is True and list(c.tenants) == ["acme"]
    # a dump has the file's shape, and parses back to the same config (CLI flags go through it)
    assert c.model_dump()["tenants"]["trust_named"] is True and parse_config(c.model_dump()) == c
    assert with_values(c, "kv_cache", {"block_size": 16}, source="--block-size").trust_named is True
    assert "trust_named" not in parse_config({"tenants": {"acme": {}}}).model_dump()["tenants"]
    with pytest.raises(ConfigError, match="'trust_named' is reserved: give that tenant another name"):
        parse_config({"tenants": {"trust_named": {"cache_salts": ["s"]}}})
    with pytest.raises(ConfigError, match="true or false"):
        parse_config({"tenants": {"trust_named": "yes"}})
    with pytest.raises(ConfigError, match="write it as tenants.trust_named"):
        parse_config({"trust_named": True})


@pytest.mark.parametrize("data, must_say", [
    ({"kv_cache": {"block_size": True}}, "kv_cache.block_size = True: expected an integer, got a boolean"),
    ({"kv_cache": {"block_size": "16"}}, "kv_cache.block_size = '16': expected an integer, got a string"),
    ({"kv_cache": {"block_size": 16.0}}, "kv_cache.block_size = 16.0: expected an integer, got a decimal number"),
    ({"kv_cache": {"ttl_hours": "4"}}, "kv_cache.ttl_hours = '4': expected a number, got a string"),
    ({"kv_cache": {"ttl_hours": True}}, "kv_cache.ttl_hours = True: expected a number, got a boolean"),
    ({"kv_cache": {"ttl_min_hours": float("nan")}}, "kv_cache.ttl_min_hours = nan: expected a finite number"),
    ({"monitoring": {"gpu_price_per_hour": float("inf")}}, "monitoring.gpu_price_per_hour = inf: expected a finite"),
    ({"agent": {"link_bytes_per_s": float("inf")}}, "agent.link_bytes_per_s = inf: expected a finite number"),
    ({"loader": {"verify_payload": 1}}, "loader.verify_payload = 1: expected a boolean (true or false), got an int"),
    ({"loader": {"fetch_workers": False}}, "loader.fetch_workers = False: expected an integer, got a boolean"),
    ({"loader": {"pool_bytes": 0}}, "loader.pool_bytes = 0: Input should be greater than or equal to 1"),
    ({"loader": {"write_back_queue_bytes": "0GiB"}}, "loader.write_back_queue_bytes = '0GiB': Input should be greater"),
    ({"loader": {"pool_bytes": True}}, "loader.pool_bytes = True: expected a size"),
    ({"loader": {"pool_bytes": -1}}, "loader.pool_bytes = -1: expected a size"),
    ({"store": {"nvme_cap": "lots"}}, "store.nvme_cap = 'lots': 'lots' is not a size"),
    ({"store": {"s3": {"retries": "2"}}}, "store.s3.retries = '2': expected an integer, got a string"),
    ({"store": {"url": 5}}, "store.url = 5: expected a string, got an integer"),
    ({"kv_cache": {"keep_layers": [0, 0]}}, "kv_cache.keep_layers = [0, 0]: layer 0 is listed twice"),
    ({"kv_cache": {"keep_layers": [True]}}, "kv_cache.keep_layers[0] = True: expected an integer, got a boolean"),
    ({"kv_cache": {"keep_layers": 3}}, "kv_cache.keep_layers = 3: expected a list, got an integer"),
    ({"kv_cache": 3}, "kv_cache = 3: expected a mapping of keys, got an integer"),
    ({"tenants": {"acme": {"cache_salts": "s-acme"}}}, "tenants.acme.cache_salts = 's-acme': expected a list"),
])
def test_wrong_types_are_refused_with_the_key_and_the_type_it_takes(data: dict, must_say: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert must_say in str(err.value)


def test_every_file_format_and_cli_values_still_parse(tmp_path: Path) -> None:
    """Strict types take what files and argparse give: YAML/JSON/TOML lists for tuples, ints for floats."""
    y = tmp_path / "k.yaml"
    y.write_text("kv_cache:\n  keep_layers: [0, 3]\n  ttl_hours: 3\n  similarity_threshold: 1\nstore:\n"
                 "  nvme_cap: 1073741824\n  evict_to_fraction: 1\nloader:\n  pool_bytes: 512MiB\n"
                 "  verify_payload: false\ntenants:\n  acme:\n    cache_salts: [salt-one-0123456789, salt-two-0123456789]\n")
    j = tmp_path / "k.json"
    j.write_text(json.dumps(load_config(y).model_dump()))
    t = tmp_path / "k.toml"
    t.write_text('[kv_cache]\nkeep_layers = [0, 3]\nttl_hours = 3\nsimilarity_threshold = 1\n'
                 '[loader]\npool_bytes = "512MiB"\nverify_payload = false\n'
                 '[tenants.acme]\ncache_salts = ["salt-one-0123456789", "salt-two-0123456789"]\n')
    a, b, c = load_config(y), load_config(j), load_config(t)
    assert a == b and c.kv_cache == a.kv_cache and c.tenants == a.tenants and c.loader == a.loader
    assert a.kv_cache.keep_layers == (0, 3) and a.kv_cache.ttl_hours == 3.0
    assert a.tenants["acme"].cache_salts == ("salt-one-0123456789", "salt-two-0123456789")
    # a CLI flag's value (argparse's int) and a KVLoader keyword, checked as the file's values are
    assert with_values(a, "kv_cache", {"block_size": 16}, source="--block-size").kv_cache.block_size == 16
    with pytest.raises(ConfigError, match=r"--block-size.*\n  kv_cache.block_size = True: expected an integer"):
        with_values(a, "kv_cache", {"block_size": True}, source="--block-size")
    assert a.loader.with_overrides(sync_fetch_timeout_s=1, pool_dir=tmp_path).sync_fetch_timeout_s == 1.0
    with pytest.raises(ConfigError, match="loader.fetch_workers = '2': expected an integer"):
        a.loader.with_overrides(fetch_workers="2")


def test_keep_layers_beyond_the_model_are_refused_once_the_model_is_known() -> None:
    p = parse_config({"kv_cache": {"keep_layers": [0, 31]}}).kv_cache.precision()
    p.check_layers(32)
    with pytest.raises(ConfigError, match=r"kv_cache.keep_layers = \[0, 31\]: layer 31 is outside model 'x', which "
                                          r"has 4 layers \(0 to 3\); list only layers below 4, e.g. \[0\] or \[0, 3\]"):
        p.check_layers(4, model="model 'x'")
