"""The training run of the default built-in model, and how built-ins are rebuilt when their recipe changes."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import prefill.models as models
from prefill.models import _corpus
from prefill.training import TrainingRecipe, token_stream, train


def _micro_model(vocab: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=vocab, max_position_embeddings=256)
    return LlamaForCausalLM(cfg)


def test_recipe_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="steps"):
        TrainingRecipe(steps=0)
    with pytest.raises(ValueError, match="held_out"):
        TrainingRecipe(held_out=-1)


def test_token_stream_ends_every_text_with_end_of_text(tiny) -> None:
    texts = _corpus()[:3]
    ids = token_stream(tiny.tokenizer, texts)
    eos = tiny.tokenizer.eos_token_id
    assert int((ids == eos).sum()) == 3 and int(ids[-1]) == eos
    assert ids.tolist()[: len(tiny.encode(texts[0]))] == tiny.encode(texts[0])


def test_training_lowers_the_loss_and_is_repeatable(tiny) -> None:
    tokens = token_stream(tiny.tokenizer, _corpus()[60:80])
    recipe = TrainingRecipe(steps=40, batch=4, seq_len=32, lr=1e-2)
    a, b = _micro_model(tiny.config.vocab_size), _micro_model(tiny.config.vocab_size)
    ra, rb = train(a, tokens, recipe), train(b, tokens, recipe)
    assert ra.final_loss < ra.first_loss - 1.0, ra
    assert ra.tokens_seen == 40 * 4 * 32
    # same seed, same batches, same thread count: the same weights
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    assert ra.final_loss == rb.final_loss and not a.training


def test_training_refuses_too_little_text(tiny) -> None:
    with pytest.raises(ValueError, match="tokens"):
        train(_micro_model(64), torch.arange(10), TrainingRecipe(seq_len=32))


def test_the_held_out_prompts_are_not_in_the_training_stream(tiny) -> None:
    # what the accuracy tests feed the model (the first 101 tokens of each held-out prompt)
    # never occurs in training; two near-duplicate prompts of the corpus share an opening
    # of ~40 tokens, which is why shorter windows are not checked
    def text_of(ids) -> str:
        return " " + " ".join(map(str, ids)) + " "

    trained = text_of(token_stream(tiny.tokenizer, _corpus()[models.HELD_OUT_PROMPTS:]).tolist())
    for text in _corpus()[: models.HELD_OUT_PROMPTS]:
        assert text_of(tiny.encode(text)[:101]) not in trained
    assert text_of(tiny.encode(_corpus()[models.HELD_OUT_PROMPTS])[:101]) in trained  # the check can fail


def test_the_default_model_was_trained_by_the_current_recipe(tiny) -> None:
    record = json.loads((tiny.path / "kvwarm-builtin.json").read_text())
    assert record["training"] == models.TRAINING[models.DEFAULT_MODEL].as_dict()
    assert record["trained"]["final_loss"] < record["trained"]["first_loss"] / 2


def test_a_builtin_built_by_another_recipe_is_rebuilt(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVWARM_HOME", str(tmp_path))
    monkeypatch.setitem(models.TRAINING, models.DEFAULT_MODEL, TrainingRecipe(steps=2, batch=2, seq_len=16))
    d = models.resolve(models.DEFAULT_MODEL)
    first = json.loads((d / "kvwarm-builtin.json").read_text())
    assert first["training"]["steps"] == 2 and "trained" in first
    assert models.resolve(models.DEFAULT_MODEL) == d  # current: not rebuilt
    assert json.loads((d / "kvwarm-builtin.json").read_text()) == first

    monkeypatch.setitem(models.TRAINING, models.DEFAULT_MODEL, TrainingRecipe(steps=3, batch=2, seq_len=16))
    models.resolve(models.DEFAULT_MODEL)
    assert json.loads((d / "kvwarm-builtin.json").read_text())["training"]["steps"] == 3

    (d / "kvwarm-builtin.json").unlink()  # a build from before recipes were recorded
    models.resolve(models.DEFAULT_MODEL)
    assert (d / "kvwarm-builtin.json").exists() and (d / "config.json").exists()
    assert not [p for p in tmp_path.joinpath("models").iterdir() if p.name.startswith(".kvwarm-tiny-")]
