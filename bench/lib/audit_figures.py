"""The figures of bench/audit_tolerance.py: how far correct and wrong KV lie from the model's recomputation.

For each store an engine wrote back (bf16, FP8), and each compute dtype of the audit (bf16,
fp32), every written-back block is compared with the model's KV by the agreement rule's own
function (:func:`prefill.agreement.judge`, tolerance 0, so every check reports its raw figures).
Wrong KV is made through the real encoder (:func:`store.format.encode.build_snapshot`, so its
recorded error is what a writer would record) from wrong computations of each block after the
first (after a garbage prefix, with no prefix, shifted by one token, another prompt's block) and
from the right KV with two of its 256 tokens replaced, and compared the same way.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import torch

from prefill.agreement import TOLERANCE, Tolerance, Verdict, judge
from prefill.models import LoadedModel, load_model
from store.config import load_config
from store.format.encode import build_snapshot, snapshot_bytes
from store.format.precision import Precision
from store.format.snapshot import Snapshot, read_snapshot
from store.identity.keys import Block, block_chain
from store.tiers.store import Store

TENANT = "acme"
KV = list[tuple[torch.Tensor, torch.Tensor]]
#: no tolerance: each check reports its raw distance (the default rule is applied to the figures after)
RAW = Tolerance(0.0, 0.0, 0.0)


def _kv(model: LoadedModel, ids: list[int]) -> Any:
    with torch.inference_mode():
        return model.model(torch.tensor([ids]), use_cache=True).cache.layers


def _block(layers: Any, n: int, bs: int) -> KV:
    sl = slice(n * bs, (n + 1) * bs)
    return [(layer.keys[0, :, sl].float(), layer.values[0, :, sl].float()) for layer in layers]


def _stored(snap: Snapshot) -> tuple[KV, dict[str, list[float]], list[str]]:
    h = snap.header
    n = h.layout.num_layers
    return ([snap.layer(i, torch.float32) for i in range(n)], h.quant_error,
            [h.precision.layer_dtype(i) for i in range(n)])


def _per_token_max(stored: KV, ref: KV) -> float:
    """The largest relative distance of one token (its heads and dims) in any layer, K or V."""
    worst = 0.0
    for (sk, sv), (rk, rv) in zip(stored, ref):
        for s, r in ((sk, rk), (sv, rv)):
            num = (s - r).permute(1, 0, 2).flatten(1).norm(dim=1)
            den = r.permute(1, 0, 2).flatten(1).norm(dim=1).clamp_min(1e-12)
            worst = max(worst, float((num / den).max()))
    return worst


def _summary(verdicts: list[Verdict]) -> dict[str, Any]:
    """Per layer and K/V: the largest measured distance, recorded error and excess over it."""
    out: dict[str, Any] = {}
    for v in verdicts:
        for c in v.checks:
            d = out.setdefault(f"{c.kind}{c.layer}", {"measured_max": 0.0, "recorded_max": 0.0, "excess_max": 0.0,
                                                      "measured_min": float("inf")})
            d["measured_max"] = max(d["measured_max"], c.measured)
            d["measured_min"] = min(d["measured_min"], c.measured)
            d["recorded_max"] = max(d["recorded_max"], c.recorded or 0.0)
            d["excess_max"] = max(d["excess_max"], c.excess)
    return {k: {f: round(x, 5) for f, x in d.items()} for k, d in sorted(out.items())}


def _wrong_cases(ids: list[int], other: list[int], n: int, bs: int, garbage: list[int]) -> dict[str, tuple[list[int], int]]:
    """For block ``n``: token sequences whose block ``index`` is wrong KV for block n of ``ids``."""
    lo, hi = n * bs, (n + 1) * bs
    return {"garbage_prefix": (garbage[:lo] + ids[lo:hi], n), "no_prefix": (ids[lo:hi], 0),
            "shifted_one_token": (ids[:hi + 1][1:], n), "another_block": (other[:hi], n)}


def figures(model_dir: Path, configs: dict[str, Path], prompts: list[list[int]]) -> dict[str, Any]:
    """The calibration's figures (see the module doc) for the stores ``configs`` names by compression,
    written back by an engine running the model in ``model_dir``."""
    out: dict[str, Any] = {}
    models = {dt: load_model(str(model_dir), dtype=dt, device="cpu") for dt in ("bf16", "fp32")}
    g = torch.Generator().manual_seed(0)
    for compression, cfg_path in configs.items():
        cfg = load_config(cfg_path)
        precision, bs = cfg.kv_cache.precision(), cfg.kv_cache.block_size
        tenant = cfg.tenant(TENANT)
        store = Store.open(cfg.store.url, cfg)
        for dt, model in models.items():
            root = model.key_root(precision, bs, tenant.salt)
            verdicts, token_max, origins = [], 0.0, set()
            wrong: dict[str, list[Verdict]] = {}
            for p, ids in enumerate(prompts):
                layers = _kv(model, ids)
                chain = block_chain(root, ids)
                for b in chain:
                    snap = store.get(tenant, b, root)
                    if snap is None:
                        continue
                    origins.add(snap.header.origin)
                    ref = _block(layers, b.index, bs)
                    kv, rec, dtypes = _stored(snap)
                    verdicts.append(judge(kv, ref, rec, dtypes, tolerance=RAW))
                    token_max = max(token_max, _per_token_max(kv, ref))
                    snap.close()
                    if b.index == 0:
                        continue
                    garbage = torch.randint(4, 4000, (len(ids),), generator=g).tolist()
                    for case, (seq, at) in _wrong_cases(ids, prompts[(p + 1) % len(prompts)], b.index, bs,
                                                        garbage).items():
                        bad = _block(_kv(model, seq), at, bs)
                        wrong.setdefault(case, []).append(_judge_built(b, root, tenant.name, bad, precision, ref))
                    wrong.setdefault("two_tokens_replaced", []).append(
                        _judge_built(b, root, tenant.name, _two_tokens_replaced(ref), precision, ref))
            out[f"{compression}/{dt}"] = {
                "snapshots": len(verdicts), "sources": sorted(origins), "per_layer": _summary(verdicts),
                "excess_max": round(max(c.excess for v in verdicts for c in v.checks), 5),
                "tolerance_used_max": round(max(_used(c) for v in verdicts for c in v.checks), 3),
                "flagged_by_default_rule": sum(map(_flagged, verdicts)),
                "per_token_max": round(token_max, 4),
                "wrong": {case: {"flagged_by_default_rule": f"{sum(map(_flagged, vs))}/{len(vs)}",
                                 "min_of_worst_layer": round(min(max(c.measured for c in v.checks) for v in vs), 4),
                                 "min_layer_ge1": round(min(c.measured for v in vs for c in v.checks if c.layer >= 1), 4),
                                 "per_layer_min": {k: d["measured_min"] for k, d in _summary(vs).items()}}
                          for case, vs in wrong.items()}}
        store.close()
    return out


def _used(check: Any) -> float:
    """The share of the default rule's tolerance at its layer that a check's excess uses."""
    return check.excess / TOLERANCE.at(check.layer)


def _flagged(verdict: Verdict) -> bool:
    """Whether the default rule (:data:`prefill.agreement.TOLERANCE`) calls this block different."""
    return any(c.measured > c.trusted + TOLERANCE.at(c.layer) for c in verdict.checks)


def _two_tokens_replaced(ref: KV) -> KV:
    """The right KV but for two tokens (10 and 11), which hold the KV of tokens 200 and 201 of the block."""
    out = []
    for k, v in ref:
        k, v = k.clone(), v.clone()
        k[:, 10:12], v[:, 10:12] = k[:, 200:202], v[:, 200:202]
        out.append((k, v))
    return out


def _judge_built(block: Block, root: Any, tenant: str, kv: KV, precision: Precision, ref: KV) -> Verdict:
    """Wrong KV stored as a writer would store it (the real encoder), judged against the model's."""
    enc = build_snapshot(root=root, block=block, tenant=tenant, kv=[(k.to(torch.bfloat16), v.to(torch.bfloat16))
                                                                    for k, v in kv],
                         precision=precision, created_at=0.0, ttl_s=60.0)
    snap = read_snapshot(pa.py_buffer(snapshot_bytes(enc)))
    stored, rec, dtypes = _stored(snap)
    return judge(stored, ref, rec, dtypes, tolerance=RAW)

