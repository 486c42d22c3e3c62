"""Issue 31, point 3: a tenant is selected only through a secret it holds, and secrets are hard to guess.

Each test is one reproduced attack: a request without a (or with an empty) cache_salt acting as a
salted default tenant, a config that allows it, one-character secrets and cache_salts, a salt_id
that tests a guessed secret at SHA-256 speed, cache_salts only in the config's plain text.
"""
from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path

import pytest

from store.config import parse_config
from store.engines.vllm.settings import ConnectorConfigError, parse_settings
from store.engines.vllm.tenancy import TenantBook
from store.errors import ConfigError
from store.identity.keys import salt_id
from store.identity.tenant import Tenant
from tests.store.engines.vllm.scheduler_fakes import KB, Req, role, store_prefix, tokens

ACME_SALT, BOLT_SALT = "acme-salt-0123456789abcdef", "bolt-salt-0123456789abcdef"
SALTED = {"kv_cache": {"block_size": KB},
          "tenants": {"acme": {"cache_salts": [ACME_SALT]}, "bolt": {"cache_salts": [BOLT_SALT]}}}


def _ask(r, req: Req) -> tuple[int | None, bool]:
    r.on_new_request(req)
    return r.get_num_new_matched_tokens(req, 0)


@pytest.mark.parametrize("salt", [None, ""], ids=["no_salt", "empty_salt"])
def test_attack_request_without_a_salt_loads_the_salted_default_tenants_kv_is_refused(tmp_path, salt) -> None:
    """The connector's default tenant is acme, which lists cache_salts; acme's prefix is stored. A
    request with no cache_salt (or ``""``) loaded acme's KV. Now the scheduler role refuses to start
    with that default, and with the default ``public`` the same request loads nothing of acme's."""
    cfg = parse_config(SALTED)
    ids = tokens(2 * KB + 1, seed=31)
    store_prefix(tmp_path, ids, namespace="acme", cfg=cfg)
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.tenant.*tenants\.acme\.cache_salts"):
        role(tmp_path, tenant="acme", cfg=cfg)
    public = role(tmp_path, tenant="public", cfg=cfg)
    assert _ask(public, Req("r", ids, cache_salt=salt)) == (0, False)
    assert _ask(public, Req("s", ids, cache_salt=ACME_SALT)) == (2 * KB, False)  # acme, by its secret


def test_attack_config_with_a_salted_default_tenant_is_refused_at_start(tmp_path, monkeypatch) -> None:
    """``kv_connector_extra_config.tenant: acme`` with ``tenants.acme.cache_salts`` was accepted."""
    monkeypatch.setenv("KVWARM_HOME", str(tmp_path / "home"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\0" * 64)
    (model / "tokenizer.json").write_text("{}")
    cfg = tmp_path / "kvwarm.json"
    cfg.write_text(json.dumps(SALTED))
    with pytest.raises(ConnectorConfigError, match=r"kv_connector_extra_config\.tenant = 'acme'.*"
                                                   r"tenants\.acme\.cache_salts.*'public'"):
        parse_settings({"config": str(cfg), "tenant": "acme"}, served_model=str(model))
    assert parse_settings({"config": str(cfg)}, served_model=str(model)).tenant == "public"
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.tenant.*tenants\.bolt\.cache_salts"):
        TenantBook(parse_config(SALTED), "bolt")  # the worker's, the agents' and the scheduler's book


def test_attack_one_character_tenant_secret_is_refused() -> None:
    cfg = parse_config({"tenants": {"acme": {"secret_env": "ACME_SECRET"}}})
    with pytest.raises(ConfigError, match=r"tenants\.acme\.secret_env.*1 character;.*16.*openssl rand -hex 32"):
        cfg.tenant("acme", environ={"ACME_SECRET": "x"})
    with pytest.raises(ConfigError, match="15 characters"):
        cfg.tenant("acme", environ={"ACME_SECRET": "x" * 15})
    assert cfg.tenant("acme", environ={"ACME_SECRET": "x" * 16}).name == "acme"


def test_attack_one_character_cache_salt_is_refused(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"tenants\.acme\.cache_salts.*1 character;.*openssl rand -hex 32"):
        parse_config({"tenants": {"acme": {"cache_salts": ["x"]}}})
    (tmp_path / "salts").write_text("y\n")
    cfg = parse_config({"tenants": {"acme": {"cache_salts_env": "ACME_SALTS"},
                                    "bolt": {"cache_salts_file": str(tmp_path / "salts")}}})
    with pytest.raises(ConfigError, match=r"tenants\.acme\.cache_salts_env.*1 character;"):
        TenantBook(cfg, "public", environ={"ACME_SALTS": "x"})
    with pytest.raises(ConfigError, match=r"tenants\.bolt\.cache_salts_file.*line 1.*1 character;"):
        TenantBook(cfg, "public", environ={"ACME_SALTS": ACME_SALT})


def test_attack_salt_id_tests_a_guessed_secret_at_sha256_speed_is_refused() -> None:
    """The salt_id (in every header and owner record) was SHA-256 of HMAC-SHA256(secret, name): one
    guess cost two hashes. Now the salt is scrypt's (n=2**14, r=8): every guess costs that."""
    secret = "correct-horse-battery-staple"
    tenant = Tenant.derive("acme", secret)
    cheap = hmac.new(secret.encode(), b"kvwarm/tenant-salt/v1\x00acme", hashlib.sha256).digest()
    assert tenant.salt_id != salt_id(cheap)
    slow = hashlib.scrypt(secret.encode(), salt=b"kvwarm/tenant-salt/v2-scrypt\x00acme", n=2**14, r=8, p=1,
                          maxmem=64 << 20, dklen=32)
    assert tenant.salt == slow and tenant.salt_id == salt_id(slow)
    # tenants without a secret and public keep their (well-known) salts
    assert Tenant.derive("acme").salt == hashlib.sha256(b"kvwarm/tenant-salt/v1\x00acme").digest()


def test_attack_cache_salts_only_in_the_config_files_plain_text_is_refused(tmp_path) -> None:
    """cache_salts could only be written in the config file; now they come from a variable or a file."""
    salts = tmp_path / "acme.salts"
    salts.write_text(f"# acme's salts\n\n{ACME_SALT}\n  acme-eval-0123456789abcdef  \n")
    text = json.dumps({"tenants": {"acme": {"cache_salts_file": str(salts)},
                                   "bolt": {"cache_salts_env": "BOLT_SALTS", "cache_salts": ["bolt-plain-0123456789"]}}})
    cfg = parse_config(json.loads(text))
    book = TenantBook(cfg, "public", environ={"BOLT_SALTS": f"{BOLT_SALT}, bolt-two-0123456789abcdef"})
    assert [book.resolve(s, None).name for s in (ACME_SALT, "acme-eval-0123456789abcdef", BOLT_SALT,
                                                 "bolt-two-0123456789abcdef", "bolt-plain-0123456789")] == \
        ["acme", "acme", "bolt", "bolt", "bolt"]
    assert ACME_SALT not in text and BOLT_SALT not in text
    assert cfg.cache_salts("acme") == (ACME_SALT, "acme-eval-0123456789abcdef")
    with pytest.raises(ConfigError, match=r"tenants\.bolt\.cache_salts_env: environment variable \$BOLT_SALTS"):
        TenantBook(cfg, "public", environ={})
    salts.unlink()
    with pytest.raises(ConfigError, match=r"tenants\.acme\.cache_salts_file: file .* does not exist"):
        cfg.cache_salts("acme")
    (tmp_path / "bolt.salts").write_text(BOLT_SALT)  # one salt, two tenants: refused, without showing it
    two = parse_config({"tenants": {"acme": {"cache_salts_env": "A"},
                                    "bolt": {"cache_salts_file": str(tmp_path / "bolt.salts")}}})
    with pytest.raises(ConfigError, match="already tenant 'acme'") as err:
        two.salt_map({"A": BOLT_SALT})
    assert BOLT_SALT not in str(err.value)
