"""Model fingerprints: full-strength digests, computed once per file state, cached under kvwarm's home."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from store.identity import fingerprint as fp
from store.identity.fingerprint import IdentityError, hub_revision, identity_from_dir, model_fingerprint

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _model_dir(root: Path, weights: bytes = b"w" * 1000) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "llama"}')
    (root / "model.safetensors").write_bytes(weights)
    (root / "tokenizer.json").write_text('{"version": "1.0"}')
    return root


@pytest.fixture()
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KVWARM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture()
def hashed(monkeypatch) -> list[list[str]]:
    """Records which files each full hash read."""
    calls: list[list[str]] = []
    real = fp._hash_files

    def counting(files, domain):
        calls.append(sorted(f.name for f in files))
        return real(files, domain)

    monkeypatch.setattr(fp, "_hash_files", counting)
    return calls


def test_the_digest_is_computed_once_and_cached_under_kvwarms_home(tmp_path, home, hashed) -> None:
    d = _model_dir(tmp_path / "m")
    first = model_fingerprint(d)
    assert model_fingerprint(d) == first
    assert hashed == [["config.json", "model.safetensors"]]  # the second call read no weights
    cached = list((home / "fingerprints").iterdir())
    assert len(cached) == 1 and cached[0].name.startswith("model-")
    assert not [p for p in d.iterdir() if p.name.startswith(".kvwarm-")]  # nothing written beside the weights


def test_a_read_only_model_directory_is_fingerprinted_once(tmp_path, home, hashed) -> None:
    d = _model_dir(tmp_path / "m")
    os.chmod(d, 0o555)
    try:
        assert model_fingerprint(d) == model_fingerprint(d)
    finally:
        os.chmod(d, 0o755)
    assert len(hashed) == 1


def test_a_changed_weight_file_is_hashed_again_and_changes_the_fingerprint(tmp_path, home, hashed) -> None:
    d = _model_dir(tmp_path / "m")
    before = model_fingerprint(d)
    (d / "model.safetensors").write_bytes(b"v" * 1000)  # same size, new content (and mtime)
    os.utime(d / "model.safetensors", ns=(1, 1))
    after = model_fingerprint(d)
    assert after != before and len(hashed) == 2


def test_the_fingerprint_is_of_the_content_not_the_path(tmp_path, home) -> None:
    a, b = _model_dir(tmp_path / "a"), _model_dir(tmp_path / "b")
    assert model_fingerprint(a) == model_fingerprint(b)
    assert model_fingerprint(a) != model_fingerprint(_model_dir(tmp_path / "c", weights=b"x" * 1000))
    assert len(list((home / "fingerprints").iterdir())) == 3  # one cache entry per directory


def test_an_unreadable_cache_entry_is_recomputed(tmp_path, home, hashed) -> None:
    d = _model_dir(tmp_path / "m")
    digest = model_fingerprint(d)
    for p in (home / "fingerprints").iterdir():
        p.write_text("{not json")
    assert model_fingerprint(d) == digest and len(hashed) == 2


def test_an_unwritable_home_still_fingerprints(tmp_path, monkeypatch, hashed) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("KVWARM_HOME", str(blocker / "home"))  # a path under a file: mkdir fails
    d = _model_dir(tmp_path / "m")
    assert model_fingerprint(d) == model_fingerprint(d)
    assert len(hashed) == 2


def test_a_hub_snapshot_is_named_by_its_revision_without_reading_weights(tmp_path, home, hashed) -> None:
    snap = _model_dir(tmp_path / "hub" / "models--acme--llama-tiny" / "snapshots" / COMMIT)
    assert hub_revision(snap) == f"hf:acme/llama-tiny@{COMMIT}"
    assert model_fingerprint(snap) == f"hf:acme/llama-tiny@{COMMIT}"
    assert hashed == []
    other = _model_dir(tmp_path / "hub" / "models--acme--llama-tiny" / "snapshots" / ("f" * 40))
    assert model_fingerprint(other) != model_fingerprint(snap)  # two revisions never share keys


def test_a_directory_that_only_looks_like_a_snapshot_is_hashed(tmp_path, home, hashed) -> None:
    d = _model_dir(tmp_path / "models--acme--x" / "snapshots" / "main")  # not a commit hash
    assert hub_revision(d) is None
    assert not model_fingerprint(d).startswith("hf:") and len(hashed) == 1


def test_a_directory_without_weights_is_refused_with_what_to_pass(tmp_path, home) -> None:
    d = tmp_path / "empty"
    d.mkdir()
    (d / "config.json").write_text("{}")
    with pytest.raises(IdentityError, match="save_pretrained"):
        model_fingerprint(d)
    with pytest.raises(IdentityError, match="does not exist"):
        model_fingerprint(tmp_path / "missing")


def test_the_identity_of_a_directory_uses_the_cached_fingerprint(tmp_path, home, hashed) -> None:
    d = _model_dir(tmp_path / "m")
    one, two = identity_from_dir(d), identity_from_dir(d)
    assert one == two and one.model_fingerprint == model_fingerprint(d)
    assert sum(1 for c in hashed if "model.safetensors" in c) == 1
