"""Precision loss as defined in bench.lib.precision_loss, on the real tiny model."""
from __future__ import annotations

import pytest

from bench.lib.precision_loss import precision_loss
from prefill.models import _corpus
from store.format.precision import Precision


@pytest.fixture(scope="module")
def prompts(tiny):
    return [tiny.encode(t)[:49] for t in _corpus()[:12] if len(tiny.encode(t)) >= 49]


def test_lossless_storage_has_no_loss(tiny, prompts):
    r = precision_loss(tiny, prompts, 48, {"bf16": Precision(compression="bf16")})["bf16"]
    assert r.loss_median == 0.0 and r.top1_agreement == 1.0


def test_fp8_loses_a_little_and_keeping_layer_0_loses_less(tiny, prompts):
    # the reference-geometry bench finds layer 0 dominates FP8's loss (1.1 % -> 0.14 %)
    r = precision_loss(tiny, prompts, 48, {"fp8": Precision(), "keep0": Precision(keep_layers=(0,))},
                       reference=Precision(compression="fp32"))
    assert 0 < r["keep0"].loss_median < r["fp8"].loss_median < 0.2
    assert r["fp8"].prompts == len(prompts) >= 8


def test_a_prompt_with_nothing_after_the_prefix_is_refused(tiny):
    with pytest.raises(ValueError, match="leaves nothing"):
        precision_loss(tiny, [[1, 2, 3]], 3, {"fp8": Precision()})
