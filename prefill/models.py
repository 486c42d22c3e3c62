"""Models the prefill job runs: any Hugging Face causal LM, and two built offline.

``load_model(name)`` accepts a built-in name, a local directory saved with
``save_pretrained``, or a hub id already in the local Hugging Face cache (nothing is
downloaded when ``HF_HUB_OFFLINE=1``). The built-ins need no network at all:

- ``kvwarm-tiny`` (the default): a 4-layer Llama with grouped-query attention, for the
  demo and the tests.
- ``kvwarm-ref``: the *reference geometry* for benchmarks, about 100M parameters,
  12 layers, 12 query heads over 4 KV heads, head dim 64, so that ratios mean something.

Both are built from a ``LlamaConfig`` with a fixed seed, share a byte-level BPE
tokenizer trained locally on ``prefill/assets/corpus.jsonl`` (CC0 prompts), and are
saved once under ``$KVWARM_HOME/models`` (default ``~/.cache/kvwarm/models``).
``kvwarm-tiny`` is then trained briefly on that corpus (:mod:`prefill.training`; a few
minutes on two cores, once per machine), so that its next-token distributions are peaked
like a real model's and the accuracy tests measure the storage rather than near-ties of
random weights. ``kvwarm-ref`` keeps its random weights: it serves the speed benchmarks,
where only the geometry matters. Each built model records its recipe in
``kvwarm-builtin.json``; a model built by an older recipe is rebuilt on first use.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from prefill.training import TrainingRecipe, token_stream, train
from store.errors import BadInputError
from store.format.header import Layout
from store.format.precision import Precision
from store.home import kvwarm_home
from store.identity.fingerprint import ModelIdentity, identity_from_dir
from store.identity.keys import KeyRoot

log = logging.getLogger(__name__)

DEFAULT_MODEL = "kvwarm-tiny"
REFERENCE_MODEL = "kvwarm-ref"

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_SPECIAL = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>"]

#: Geometry of the built-in models (all Llama, fixed seed 0).
BUILTINS: dict[str, dict[str, Any]] = {
    DEFAULT_MODEL: dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=4096, max_position_embeddings=4096,
                        initializer_range=0.08),
    REFERENCE_MODEL: dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                          num_key_value_heads=4, vocab_size=32000, max_position_embeddings=16384,
                          initializer_range=0.04, tie_word_embeddings=True),
}
_TOKENIZER_VOCAB = 4096
#: Built-ins trained after initialisation (the rest keep their random weights).
TRAINING: dict[str, TrainingRecipe] = {DEFAULT_MODEL: TrainingRecipe()}
#: Bumped when the build changes in a way the recipe does not show.
_BUILD_VERSION = 2
_MARKER = "kvwarm-builtin.json"
#: The first corpus prompts, never trained on: what accuracy is measured on.
HELD_OUT_PROMPTS = TRAINING[DEFAULT_MODEL].held_out
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


class ModelError(BadInputError):
    """The model cannot be loaded or used as asked (device, dtype, chat template); the message says what to pass."""


class ModelNotFound(ModelError):
    """The model is neither a built-in, a local directory, nor in the local hub cache."""


def kv_layout(model_config: Any, block_size: int) -> Layout:
    """The geometry of a model's KV blocks, from its Hugging Face config (layers, KV heads, head dim).

    Its size in the store is :func:`store.format.payload.kv_bytes_per_token`.
    """
    heads = getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    return Layout(num_layers=int(model_config.num_hidden_layers), num_kv_heads=int(heads), head_dim=int(head_dim),
                  block_size=int(block_size))


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to prefill, with what identifies its KV.

    ``identity`` covers plain-text prompts; ``identity_for(chat=True)`` adds the chat
    template's hash for prompts that went through it.
    """

    name: str
    path: Path
    model: Any
    tokenizer: Any
    config: Any
    identity: ModelIdentity
    chat_identity: ModelIdentity | None
    device: torch.device
    dtype: torch.dtype

    def identity_for(self, chat: bool) -> ModelIdentity:
        if not chat:
            return self.identity
        if self.chat_identity is None:
            raise ModelError(f"model {self.name!r} has no chat template; pass plain text or token ids")
        return self.chat_identity

    def key_root(self, precision: Precision, block_size: int, tenant_salt: bytes, *, chat: bool = False) -> KeyRoot:
        return self.identity_for(chat).key_root(precision, block_size, tenant_salt)

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    def encode(self, text: str, *, chat: bool = False) -> list[int]:
        """Token ids of ``text`` (as a system message through the chat template when ``chat``)."""
        return encode(self.tokenizer, text, chat=chat)


def encode(tokenizer: Any, text: str, *, chat: bool = False) -> list[int]:
    """Token ids of ``text`` by ``tokenizer`` (as a system message through its chat template when ``chat``):
    what the prefill job computes for a plan entry's text, with the weights loaded or not."""
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "system", "content": text}], tokenize=True,
                                            add_generation_prompt=False)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def models_home() -> Path:
    """Where the built-in models are saved: ``models/`` under kvwarm's home (:func:`store.home.kvwarm_home`)."""
    return kvwarm_home() / "models"


def _corpus() -> list[str]:
    path = Path(__file__).parent / "assets" / "corpus.jsonl"
    return [json.loads(line)["prompt"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _train_tokenizer(out: Path) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=_TOKENIZER_VOCAB, special_tokens=_SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def _recipe_record(name: str) -> dict[str, Any]:
    recipe = TRAINING.get(name)
    return {"name": name, "build_version": _BUILD_VERSION, "geometry": BUILTINS[name],
            "training": recipe.as_dict() if recipe is not None else None}


def _is_current(d: Path, name: str) -> bool:
    try:
        recorded = json.loads((d / _MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    want = _recipe_record(name)
    return (d / "config.json").exists() and all(recorded.get(k) == v for k, v in want.items())


@contextmanager
def _build_lock(home: Path, name: str):
    """One builder per model per machine; the others wait for it (and then find its model)."""
    home.mkdir(parents=True, exist_ok=True)
    with open(home / f".{name}.lock", "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def build_builtin(name: str, out: Path) -> Path:
    """Build a built-in model into ``out``: tokenizer, weights from the config with seed 0,
    then (``kvwarm-tiny``) the training run of :data:`TRAINING`. Replaces an older build."""
    from transformers import LlamaConfig, LlamaForCausalLM

    geometry = BUILTINS[name]
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
    try:
        tokenizer = _train_tokenizer(tmp)
        cfg = LlamaConfig(**geometry, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id)
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        record = _recipe_record(name)
        recipe = TRAINING.get(name)
        if recipe is not None:
            log.warning("training built-in model %s once on the bundled corpus (%d steps; a few minutes on two "
                        "cores)", name, recipe.steps)
            report = train(model, token_stream(tokenizer, _corpus()[recipe.held_out:]), recipe)
            record["trained"] = {"first_loss": round(report.first_loss, 4), "final_loss": round(report.final_loss, 4),
                                 "tokens_seen": report.tokens_seen, "seconds": round(report.seconds, 1),
                                 "torch": torch.__version__}
            log.warning("trained %s: loss %.2f -> %.2f in %.0f s", name, report.first_loss, report.final_loss,
                        report.seconds)
        model.save_pretrained(tmp)
        (tmp / _MARKER).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        if out.exists():  # an older build: move it aside (we hold the build lock)
            stale = out.parent / f".{name}-stale-{os.getpid()}-{os.urandom(4).hex()}"
            os.replace(out, stale)
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve(name_or_path: str) -> Path:
    """Directory holding ``name_or_path``: built-in (built on first use), local dir, or hub cache."""
    if name_or_path in BUILTINS:
        d = models_home() / name_or_path
        if not _is_current(d, name_or_path):
            with _build_lock(d.parent, name_or_path):
                if not _is_current(d, name_or_path):  # another process may have built it meanwhile
                    for left in d.parent.glob(f".{name_or_path}-*"):  # a killed builder's (we hold the lock)
                        shutil.rmtree(left, ignore_errors=True)
                    log.info("building built-in model %s under %s (once)", name_or_path, d)
                    build_builtin(name_or_path, d)
        return d
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelNotFound(f"model directory {str(p)!r} has no config.json; pass a directory saved with save_pretrained")
        return p
    if p.exists() or name_or_path.startswith((".", "/", "~")):
        raise ModelNotFound(f"model path {name_or_path!r} does not exist or is not a directory")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name_or_path, local_files_only=os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0")))
    except Exception as exc:  # noqa: BLE001 - hub errors come in many types; all mean the same here
        raise ModelNotFound(
            f"unknown model {name_or_path!r}: not a built-in ({', '.join(BUILTINS)}), not a local directory, "
            f"and not available from the Hugging Face hub or its local cache ({type(exc).__name__})") from None


def pick_device(device: str | None) -> torch.device:
    """The torch device for ``device`` (``None``/``auto``: cuda when present, else cpu).

    Raises:
        ModelError: not a device name, or a CUDA device where CUDA is not available.
    """
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ModelError(f"device {device!r} is not a device: use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"device {device!r} requested but CUDA is not available here; use --device cpu")
    return dev


def pick_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch dtype for a name in :data:`DTYPES` (a ``torch.dtype`` passes through).

    Raises:
        ModelError: an unknown name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ModelError(f"dtype {dtype!r} is not supported; use one of bf16, fp16, fp32")
    return DTYPES[dtype]


def load_model(name_or_path: str = DEFAULT_MODEL, *, dtype: str | torch.dtype = "fp32",
               device: str | None = None) -> LoadedModel:
    """Load a causal LM and its tokenizer, and fingerprint them for the key root.

    The dtype and device are checked before the model is resolved (building a built-in
    the first time takes minutes).

    Raises:
        ModelError: a bad dtype or device; :class:`ModelNotFound` for an unknown model.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = pick_dtype(dtype)
    dev = pick_device(device)
    path = resolve(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(dev).eval()
    identity = identity_from_dir(path)
    chat_identity = identity_from_dir(path, chat=True) if getattr(tokenizer, "chat_template", None) else None
    return LoadedModel(name=name_or_path, path=path, model=model, tokenizer=tokenizer, config=model.config,
                       identity=identity, chat_identity=chat_identity, device=dev, dtype=dtype)


def load_tokenizer(name_or_path: str = DEFAULT_MODEL) -> Any:
    """The tokenizer of a model (built-in, local directory or hub id), without loading its weights."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve(name_or_path))
