"""A short training run that turns the default built-in model into a (very small) language model.

With random weights, next-token logits are nearly tied far more often than a trained
model's, so any perturbation of the KV (FP8 storage above all) flips greedy choices and
the accuracy tests measure the weights rather than the storage. A few minutes of training
on the bundled CC0 corpus gives the tiny model the peaked, text-like distributions of a
real one. The first ``held_out`` corpus prompts are never trained on: the accuracy tests
and docs/concepts/precision.md measure on them.

Deterministic on one machine (fixed seed, fixed batches); another CPU may round its
matmuls differently, train slightly different weights and so fingerprint the model
differently: its snapshots are then its own, which is what the key identity is for.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainingRecipe:
    """Everything that decides the trained weights (recorded next to them; a change rebuilds).

    Attributes:
        steps: optimiser steps (AdamW, linear warm-up over 5 %, cosine decay to zero).
        batch: sequences per step.
        seq_len: tokens per sequence, sampled at random offsets of the corpus stream.
        lr: peak learning rate.
        weight_decay: AdamW weight decay.
        seed: seed of the batch sampler (the initial weights use the model's own seed).
        held_out: the first ``held_out`` corpus prompts are left out of training.
    """

    steps: int = 800
    batch: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    weight_decay: float = 0.01
    seed: int = 0
    held_out: int = 50

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainingRecipe.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.held_out < 0:
            raise ValueError(f"TrainingRecipe.held_out must be >= 0, got {self.held_out!r}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TrainingReport:
    """What a training run did: loss at the start and the end (mean of the last 20 steps)."""

    steps: int
    tokens_seen: int
    first_loss: float
    final_loss: float
    seconds: float


def token_stream(tokenizer: Any, texts: Sequence[str]) -> torch.Tensor:
    """The texts' token ids, each followed by the end-of-text token, as one 1-D tensor."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for row in tokenizer(list(texts), add_special_tokens=False)["input_ids"]:
        ids.extend(row)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def train(model: Any, tokens: torch.Tensor, recipe: TrainingRecipe) -> TrainingReport:
    """Train ``model`` (a causal LM, in place, fp32) on random windows of ``tokens``."""
    if tokens.numel() < recipe.seq_len + 2:
        raise ValueError(f"training needs more than {recipe.seq_len + 1} tokens, got {tokens.numel()}")
    g = torch.Generator().manual_seed(recipe.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay, betas=(0.9, 0.95))
    warm = max(1, recipe.steps // 20)

    def factor(step: int) -> float:
        return min(1.0, (step + 1) / warm) * 0.5 * (1.0 + math.cos(math.pi * min(step, recipe.steps) / recipe.steps))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    offsets = torch.arange(recipe.seq_len)
    losses: list[float] = []
    model.train()
    t0 = time.perf_counter()
    for step in range(recipe.steps):
        starts = torch.randint(0, tokens.numel() - recipe.seq_len - 1, (recipe.batch,), generator=g)
        x = tokens[starts[:, None] + offsets]
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if step % 100 == 0 or step == recipe.steps - 1:
            log.info("training step %d/%d: loss %.3f (%.0f s)", step + 1, recipe.steps, losses[-1],
                     time.perf_counter() - t0)
    model.eval()
    tail = losses[-20:]
    return TrainingReport(steps=recipe.steps, tokens_seen=recipe.steps * recipe.batch * recipe.seq_len,
                          first_loss=losses[0], final_loss=sum(tail) / len(tail),
                          seconds=time.perf_counter() - t0)
