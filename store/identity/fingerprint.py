"""Model identity: the fingerprints that, with the precision and the tenant, root every key.

The prefill job (which has transformers) and the serving-side loader (which has only
``store`` and torch) must compute the same root for the same model, so the
fingerprints are computed here from the model's *files*, without importing
transformers. A model directory is fingerprinted by hashing its config and weights in
full (a fingerprint that skipped bytes could miss a fine-tune that changed only some
tensors), so two revisions never share keys.

Hashing every weight byte at every engine start would cost minutes for a large model
(140 GB for a 70B model in bf16), and engines often serve from read-only volumes. So:

- the digest is cached under kvwarm's own home (:func:`store.home.kvwarm_home`,
  ``fingerprints/``), keyed by the directory's resolved path and the names, sizes and
  mtimes of its files: a changed file is hashed again, an unchanged one never is, and
  the model directory itself is never written;
- a Hugging Face hub snapshot (``.../models--ORG--NAME/snapshots/COMMIT``) is named by
  its repository and commit (``hf:ORG/NAME@COMMIT``) without reading the weights: the
  commit already pins every byte of the revision.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from store.errors import BadInputError
from store.format.precision import Precision
from store.home import kvwarm_home
from store.identity.keys import KeyRoot

log = logging.getLogger("kvwarm.identity")

#: Files whose bytes define the weights. Large files are hashed in full: a fingerprint
#: that skipped bytes could miss a fine-tune that changed only some tensors.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_CONFIG_FILES = ("config.json", "generation_config.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")
_CHUNK = 8 << 20


class IdentityError(BadInputError):
    """A model or tokenizer cannot be fingerprinted (missing files, unpinned revision)."""


@dataclass(frozen=True)
class ModelIdentity:
    """What identifies a model's KV, independent of how it is stored.

    Attributes:
        model_fingerprint: digest of config + weights, or ``hub_id@commit``.
        tokenizer_fingerprint: digest of the tokenizer files.
        chat_template_hash: digest of the chat template ("" when the prompts were not templated).
        adapter_hash: digest of a LoRA adapter ("" for none).
        name: a human name for logs (not part of the key).
    """

    model_fingerprint: str
    tokenizer_fingerprint: str
    chat_template_hash: str = ""
    adapter_hash: str = ""
    name: str = ""

    def key_root(self, precision: Precision, block_size: int, tenant_salt: bytes) -> KeyRoot:
        """The chain root for this model stored at ``precision`` in blocks of ``block_size``."""
        return KeyRoot(model_fingerprint=self.model_fingerprint, tokenizer_fingerprint=self.tokenizer_fingerprint,
                       kv_dtype=precision.kv_dtype, quant_scheme=precision.scheme_id(), block_size=block_size,
                       tenant_salt=tenant_salt, chat_template_hash=self.chat_template_hash,
                       adapter_hash=self.adapter_hash)


def _hash_files(files: list[Path], domain: bytes) -> str:
    h = hashlib.sha256(domain)
    for f in sorted(files, key=lambda p: p.name):
        h.update(f.name.encode() + b"\x00" + f.stat().st_size.to_bytes(8, "little"))
        with open(f, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def _stamp(d: Path, files: list[Path]) -> str:
    """What the cached digest is valid for: the directory's resolved path and each file's name, size and mtime."""
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return hashlib.sha256(json.dumps([str(d.resolve()), stats]).encode()).hexdigest()


def _cache_file(d: Path, kind: str) -> Path:
    where = hashlib.sha256(str(d.resolve()).encode()).hexdigest()[:32]
    return kvwarm_home() / "fingerprints" / f"{kind}-{where}.json"


def _cached(d: Path, kind: str, files: list[Path], compute) -> str:  # type: ignore[no-untyped-def]
    """``compute()`` once per (path, names, sizes, mtimes) of ``files``; the digest is kept under kvwarm's home."""
    stamp = _stamp(d, files)
    cache = _cache_file(d, kind)
    try:
        doc = json.loads(cache.read_text())
        if doc.get("stamp") == stamp:
            return str(doc["digest"])
    except (OSError, ValueError, KeyError, AttributeError):
        pass  # no cache yet, or one that is unreadable: compute again
    digest = compute()
    try:  # best effort: an unwritable home only means hashing again next time
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"path": str(d.resolve()), "stamp": stamp, "digest": digest}))
        os.replace(tmp, cache)
    except OSError as exc:
        log.info("could not cache the fingerprint of %s under %s: %s", d, cache.parent, exc)
    return digest


#: A Hugging Face hub cache snapshot: ``.../models--ORG--NAME/snapshots/<40-hex commit>``.
_HUB_SNAPSHOT = re.compile(r"(?:^|/)models--(?P<repo>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})/?$")


def hub_revision(path: str | os.PathLike[str]) -> str | None:
    """``hf:ORG/NAME@COMMIT`` when ``path`` is a hub cache snapshot directory, else ``None``."""
    m = _HUB_SNAPSHOT.search(Path(path).absolute().as_posix())
    if m is None:
        return None
    return f"hf:{m['repo'].replace('--', '/')}@{m['commit']}"


def chat_template_hash(template: str | None) -> str:
    """Digest of a chat template's text ("" for none)."""
    if not template:
        return ""
    return hashlib.sha256(b"kvwarm/chat-template/v1\x00" + template.encode("utf-8")).hexdigest()


def tokenizer_fingerprint(path: str | os.PathLike[str]) -> str:
    """Digest of the tokenizer files in a model or tokenizer directory."""
    d = Path(path)
    files = [d / n for n in _TOKENIZER_FILES if (d / n).is_file()]
    if not files:
        raise IdentityError(f"no tokenizer files ({', '.join(_TOKENIZER_FILES[:3])}, ...) in {str(d)!r}")
    return _hash_files(files, b"kvwarm/tokenizer/v1\x00")


def model_fingerprint(path: str | os.PathLike[str]) -> str:
    """The identity of a model directory's weights: its hub revision for a hub snapshot, else a
    digest of its config and weight files (cached under kvwarm's home per path, size and mtime)."""
    d = Path(path)
    if not d.is_dir():
        raise IdentityError(f"model directory {str(d)!r} does not exist")
    weights = [p for p in d.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES)]
    configs = [d / n for n in _CONFIG_FILES if (d / n).is_file()]
    if not weights or not configs:
        raise IdentityError(f"{str(d)!r} has no config.json and weight files; pass a model directory "
                            f"saved with save_pretrained, or a hub id with a pinned revision")
    revision = hub_revision(d)
    if revision is not None:
        return revision
    files = sorted(configs + weights, key=lambda p: p.name)
    return _cached(d, "model", files, lambda: _hash_files(files, b"kvwarm/model/v1\x00"))


def _chat_template_in(d: Path) -> str | None:
    jinja = d / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    cfg = d / "tokenizer_config.json"
    if cfg.is_file():
        try:
            t = json.loads(cfg.read_text(encoding="utf-8")).get("chat_template")
        except ValueError:
            return None
        return t if isinstance(t, str) else None
    return None


def identity_from_dir(path: str | os.PathLike[str], *, chat: bool = False, adapter_hash: str = "") -> ModelIdentity:
    """Identity of a model saved in a local directory (weights, config, tokenizer).

    ``chat`` says whether prompts go through the directory's chat template (its hash
    then enters the key; otherwise the chat-template hash is empty).
    """
    d = Path(path)
    template = _chat_template_in(d) if chat else None
    if chat and template is None:
        raise IdentityError(f"chat=True but {str(d)!r} has no chat template")
    return ModelIdentity(model_fingerprint=model_fingerprint(d), tokenizer_fingerprint=tokenizer_fingerprint(d),
                         chat_template_hash=chat_template_hash(template), adapter_hash=adapter_hash, name=d.name)
