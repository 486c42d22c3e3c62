"""copy_into_paged and the dequantisers behind it, against a cold prefill of a real (tiny) model."""
from __future__ import annotations

import pytest
import torch

from store.engines.paged import new_dynamic_cache
from store.format.precision import Precision, dequantize, quantize
from store.format.runs import payload_plan
from store.kernels.dequant import Dequantizer, dequantize_into
from store.kernels.staging import SLOTS
from store.serving.loader import KVLoader
from store.tiers.store import Store
from tests.store.pool_workers import ACME, TINY, config, prefill_kv, prompt, tiny_model, write_prefix

BS = 16


@pytest.fixture(scope="module")
def bf16_model():
    return tiny_model(torch.bfloat16)


def loader_for(tmp_path, compression: str, model, ids):
    cfg = config(BS, compression)
    store = Store.open(f"file://{tmp_path}/nvme", cfg)
    write_prefix(store, cfg, model, ids)
    store.close()
    return KVLoader(f"file://{tmp_path}/nvme", tenant=ACME, model=TINY, pool_bytes=1 << 30, config=cfg,
                    pool_dir=tmp_path / "pool")


def reference_paged(kv, block_ids, ebs, num_blocks, tokens, dtype):
    """The paged caches a cold prefill fills, built token by token (the obvious, slow way)."""
    heads, _, dim = kv[0][0].shape
    caches = [torch.full((2, num_blocks, ebs, heads, dim), -7.0, dtype=dtype) for _ in kv]
    for layer, (k, v) in enumerate(kv):
        for t in range(tokens):
            caches[layer][0, block_ids[t // ebs], t % ebs] = k[:, t].to(dtype)
            caches[layer][1, block_ids[t // ebs], t % ebs] = v[:, t].to(dtype)
    return caches


@pytest.mark.parametrize("ebs", [16, 4, 32, 48, 5])
def test_copy_into_paged_writes_exactly_the_cold_prefill_blocks(tmp_path, bf16_model, ebs):
    model, _ = bf16_model
    ids = prompt(5 * BS + 3, seed=1)  # 5 stored blocks, and a tail the engine computes
    cold = prefill_kv(model, ids)
    loader = loader_for(tmp_path, "bf16", model, ids[: 5 * BS])
    hit = loader.lookup(ids)
    assert hit is not None and hit.tokens == 5 * BS
    num_blocks = 40
    want_blocks = -(-hit.tokens // ebs)
    block_ids = [37, 2, 19, 5, 30, 11, 8, 25, 14, 3, 21, 33, 0, 16, 28, 9, 12, 6, 39, 1, 22][:want_blocks]
    caches = [torch.full((2, num_blocks, ebs, 2, 16), -7.0, dtype=torch.bfloat16) for _ in range(2)]

    written = hit.copy_into_paged(caches, block_ids)

    assert written == hit.tokens - hit.tokens % ebs  # whole engine blocks only
    want = reference_paged(cold, block_ids, ebs, num_blocks, written, torch.bfloat16)
    for got, ref in zip(caches, want):
        assert torch.equal(got, ref)  # untouched blocks and slots keep their -7 too

    if hit.tokens % ebs:
        caches = [torch.full((2, num_blocks, ebs, 2, 16), -7.0, dtype=torch.bfloat16) for _ in range(2)]
        assert hit.copy_into_paged(caches, block_ids, partial=True) == hit.tokens
        want = reference_paged(cold, block_ids, ebs, num_blocks, hit.tokens, torch.bfloat16)
        assert all(torch.equal(g, r) for g, r in zip(caches, want))
    hit.release()
    loader.close()


def test_paged_fp8_matches_the_dequantised_snapshot_and_the_cold_prefill(tmp_path, bf16_model):
    model, _ = bf16_model
    ids = prompt(3 * BS + 1, seed=2)
    cold = prefill_kv(model, ids)
    loader = loader_for(tmp_path, "fp8", model, ids[: 3 * BS])
    hit = loader.lookup(ids)
    assert hit is not None
    caches = [torch.zeros((2, 8, 8, 2, 16), dtype=torch.bfloat16) for _ in range(2)]
    block_ids = [7, 0, 3, 5, 1, 6]
    assert hit.copy_into_paged(caches, block_ids) == 3 * BS
    for layer in range(2):
        k_ref = torch.cat([s.layer(layer, torch.bfloat16)[0] for s in hit.snapshots], dim=1)
        k_got = caches[layer][0, block_ids].reshape(3 * BS, 2, 16).transpose(0, 1)
        assert torch.equal(k_got, k_ref)  # the very bits store.format.precision.dequantize gives
        rel = (k_got.float() - cold[layer][0][:, : 3 * BS].float()).norm() / cold[layer][0][:, : 3 * BS].float().norm()
        assert rel < 0.08  # FP8 e4m3 with per-head scales
    hit.release()
    loader.close()


def test_paged_leaves_the_last_prompt_token_to_the_engine(tmp_path, bf16_model):
    model, _ = bf16_model
    ids = prompt(2 * BS, seed=3)
    loader = loader_for(tmp_path, "bf16", model, ids)
    hit = loader.lookup(ids)  # the whole prompt is stored
    assert hit.tokens == 2 * BS and hit.usable_tokens == 2 * BS - 1
    caches = [torch.zeros((2, 4, 8, 2, 16), dtype=torch.bfloat16) for _ in range(2)]
    assert hit.copy_into_paged(caches, [0, 1, 2, 3]) == 3 * 8  # whole engine blocks below 31 tokens
    assert hit.copy_into_paged(caches, [0, 1, 2, 3], partial=True) == 2 * BS - 1
    hit.release()
    loader.close()


def test_paged_refuses_caches_of_the_wrong_geometry(tmp_path, bf16_model):
    model, _ = bf16_model
    ids = prompt(BS + 1, seed=4)
    loader = loader_for(tmp_path, "bf16", model, ids[:BS])
    hit = loader.lookup(ids)
    with pytest.raises(ValueError, match="layers"):
        hit.copy_into_paged([torch.zeros((2, 4, 8, 2, 16))], [0, 1])
    with pytest.raises(ValueError, match="shape"):
        hit.copy_into_paged([torch.zeros((2, 4, 8, 3, 16))] * 2, [0, 1])
    with pytest.raises(ValueError, match="dtype"):
        hit.copy_into_paged([torch.zeros((2, 4, 8, 2, 16), dtype=torch.float8_e4m3fn)] * 2, [0, 1])
    with pytest.raises(ValueError, match="block_ids"):
        hit.copy_into_paged([torch.zeros((2, 4, 8, 2, 16))] * 2, [0, 9])
    hit.release()
    with pytest.raises(RuntimeError, match="released"):
        hit.copy_into_paged([torch.zeros((2, 4, 8, 2, 16))] * 2, [0, 1])
    loader.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("precision", [Precision(), Precision(granularity="head_group", group_tokens=5),
                                       Precision(compression="fp16")])
def test_dequantize_into_is_bit_identical_to_the_reference(dtype, precision):
    g = torch.Generator().manual_seed(0)
    x = torch.randn((3, 32, 8), generator=g) * 5
    stored, scale = quantize(x, precision, 0)
    want = dequantize(stored, scale, dtype, precision.group_tokens)
    out = torch.zeros((3, 40, 8), dtype=dtype)  # a strided destination: a slice of a longer cache
    dequantize_into(out[:, 4:36], stored, scale, precision.group_tokens)
    assert torch.equal(out[:, 4:36], want)
    assert not out[:, :4].any() and not out[:, 36:].any()
    tok_major = torch.zeros((32, 3, 8), dtype=dtype)
    dequantize_into(tok_major.transpose(0, 1), stored, scale, precision.group_tokens)
    assert torch.equal(tok_major.transpose(0, 1), want)


@pytest.mark.parametrize("mode", ["compiled", "auto"])
def test_the_compiled_dequantiser_gives_the_same_bits(mode, numpy_table):  # auto compiles only without the native gather
    import concurrent.futures as cf

    g = torch.Generator().manual_seed(1)
    runs = [[quantize(torch.randn((2, 16, 8), generator=g) * 3, Precision(), 0) for _ in range(3)] for _ in range(4)]
    want = [torch.cat([dequantize(q, s, torch.bfloat16) for q, s in run], dim=1) for run in runs]
    with cf.ThreadPoolExecutor(1) as ex:
        dq = Dequantizer(mode, ex)
        got = dq.layers(runs, 48, torch.bfloat16)  # auto: the table now, the kernel built meanwhile
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert ((4, 2, 16, 8), torch.bfloat16) in dq._ready
    assert all(torch.equal(a, b) for a, b in zip(dq.layers(runs, 48, torch.bfloat16), want))  # the kernel
    two = [run[:2] for run in runs]  # another block count, trimmed
    assert all(torch.equal(a, b[:, :29]) for a, b in zip(dq.layers(two, 29, torch.bfloat16), want))


def test_the_device_path_gives_the_same_bits_and_reuses_its_staging_buffer():
    # The GPU path (one gather into a host buffer, one copy, dequantised on the device),
    # run here with the CPU as the "device": the arithmetic and layout are what a GPU gets.
    g = torch.Generator().manual_seed(2)
    runs = [[quantize(torch.randn((2, 16, 8), generator=g) * 3, Precision(), 0) for _ in range(3)] for _ in range(4)]
    want = [torch.cat([dequantize(q, s, torch.bfloat16) for q, s in run], dim=1) for run in runs]
    dq = Dequantizer("table")
    got = dq._to_device(runs, torch.bfloat16, torch.device("cpu"))
    assert all(torch.equal(got[j], want[j]) for j in range(4))
    smaller = dq._to_device([run[:2] for run in runs], torch.bfloat16, torch.device("cpu"))
    dq._to_device([run[:1] for run in runs], torch.bfloat16, torch.device("cpu"))
    assert dq._staging.allocations == SLOTS  # one per slot, each then reused
    assert all(torch.equal(smaller[j], want[j][:, :32]) for j in range(4))
    # unscaled storage (bf16) takes the same path: the bytes, moved and laid out as they were
    plain = [[quantize(torch.randn((2, 16, 8), generator=g), Precision(compression="bf16"), 0) for _ in range(3)]
             for _ in range(4)]
    got = dq._to_device(plain, torch.float32, torch.device("cpu"))
    assert all(torch.equal(got[j], torch.cat([q.float() for q, _ in run], dim=1)) for j, run in enumerate(plain))


def mapped_snapshots(tmp_path, precision: Precision, n: int, *, layers: int = 3, heads: int = 2, dim: int = 8,
                     seed: int = 3):
    """``n`` consecutive snapshots of random KV, written to files and mapped back as the loader maps them."""
    from store.format.encode import build_snapshot, snapshot_bytes
    from store.format.payload import map_file
    from store.format.snapshot import read_snapshot
    from store.identity.keys import block_chain

    root = TINY.key_root(precision, BS, ACME.salt)
    g = torch.Generator().manual_seed(seed)
    tmp_path.mkdir(parents=True, exist_ok=True)
    snaps = []
    for b in block_chain(root, list(range(n * BS + 1))):
        kv = [(torch.randn((heads, BS, dim), generator=g) * 4, torch.randn((heads, BS, dim), generator=g))
              for _ in range(layers)]
        enc = build_snapshot(root=root, block=b, tenant=ACME.name, kv=kv, precision=precision, created_at=0.0,
                             ttl_s=60.0)
        path = tmp_path / f"{b.index}.kvw"
        path.write_bytes(snapshot_bytes(enc))
        snaps.append(read_snapshot(map_file(path), verify_payload=True))
    return snaps


def per_part(snaps, tokens: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """The reference: every part dequantised alone (store.format.precision.dequantize), then concatenated."""
    layers = snaps[0].header.layout.num_layers
    out = []
    for i in range(layers):
        for name in ("k", "v"):
            parts = []
            for s in snaps:
                scale = s.tensor(f"{name}_scale.{i}") if f"{name}_scale.{i}" in s._parts else None
                parts.append(dequantize(s.tensor(f"{name}.{i}"), scale, dtype, s.header.precision.group_tokens))
            out.append(torch.cat(parts, dim=1)[:, :tokens])
    return out


@pytest.mark.parametrize("compression", ["fp8", "bf16"])
def test_whole_payloads_give_the_bits_of_each_part_dequantised_alone(tmp_path, compression):
    precision = Precision(compression=compression)
    snaps = mapped_snapshots(tmp_path, precision, 3)
    payloads = [s.payload for s in snaps]
    assert all(p is not None for p in payloads)
    assert all(p[1] is payloads[0][1] for p in payloads)  # one interned layout per geometry
    dq = Dequantizer("compiled" if compression == "fp8" else "table")
    for tokens in (3 * BS, 3 * BS - 5, BS + 1):  # whole blocks, and ending mid-block
        got = dq.payload_layers(payloads, tokens, torch.bfloat16)
        assert got is not None and len(got) == 6
        want = per_part(snaps, tokens, torch.bfloat16)
        assert all(a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))
                   for a, b in zip(got, want))
    # the mapping is read, never written
    assert all(not p[0].flags.writeable for p in payloads)


def test_whole_payloads_fall_back_where_the_layout_is_not_regular(tmp_path, numpy_table):
    # per-group scales, the table mode, a dtype other than the stored one: None, and the
    # per-part path (to_dynamic_cache) is used
    mixed = mapped_snapshots(tmp_path / "m", Precision(keep_layers=(1,)), 2)
    grouped = mapped_snapshots(tmp_path / "g", Precision(granularity="head_group", group_tokens=5), 2)
    plain = mapped_snapshots(tmp_path / "p", Precision(compression="bf16"), 2)
    fp8 = mapped_snapshots(tmp_path / "f", Precision(), 2)
    compiled = Dequantizer("compiled")
    assert compiled.payload_layers([s.payload for s in mixed], 2 * BS, torch.bfloat16) is not None  # mixed precision: handled (tests/store/kernels/test_dequant.py)
    assert compiled.payload_layers([s.payload for s in grouped], 2 * BS, torch.bfloat16) is None
    assert compiled.payload_layers([s.payload for s in plain], 2 * BS, torch.float32) is None
    assert Dequantizer("table").payload_layers([s.payload for s in fp8], 2 * BS, torch.bfloat16) is None
    # auto before its kernel is built: the table from the payloads (no second kernel started)
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(1) as ex:
        auto = Dequantizer("auto", ex)
        auto._pending.add(("payload", fp8[0].payload[1].nbytes, payload_plan(fp8[0].payload[1]), torch.bfloat16))
        got = auto.payload_layers([s.payload for s in fp8], 2 * BS - 3, torch.bfloat16)
        assert all(torch.equal(a, b) for a, b in zip(got, per_part(fp8, 2 * BS - 3, torch.bfloat16)))
        assert not auto._ready and len(auto._pending) == 1
    assert compiled.payload_layers([s.payload for s in fp8[:1]], BS, torch.bfloat16) is None  # one block
    assert compiled.payload_layers([mixed[0].payload, fp8[1].payload], 2 * BS, torch.bfloat16) is None
    assert compiled.payload_layers([s.payload for s in fp8], 2 * BS + 1, torch.bfloat16) is None  # too many tokens


@pytest.mark.parametrize("compression", ["fp8", "bf16"])
def test_to_dynamic_cache_from_whole_payloads_matches_the_per_part_path(tmp_path, bf16_model, compression):
    m, _ = bf16_model
    ids = prompt(3 * BS + 2, seed=5)
    ld = loader_for(tmp_path, compression, m, ids)
    ld.dequantizer = Dequantizer("compiled" if compression == "fp8" else "table")
    per_part_dq = Dequantizer("table")
    with ld.lookup(ids) as hit:
        payloads = [s.payload for s in hit.snapshots]
        assert ld.dequantizer.payload_layers(payloads, hit.usable_tokens, torch.bfloat16) is not None  # this path
        cache = hit.to_dynamic_cache("cpu", torch.bfloat16)
        ld.dequantizer = per_part_dq  # the table: FP8 goes part by part
        runs = [hit._parts(i, name) for i in range(hit.layout.num_layers) for name in ("k", "v")]
        want = per_part_dq.layers(runs, hit.usable_tokens, torch.bfloat16)
    for i, layer in enumerate(cache.layers):
        assert torch.equal(layer.keys[0], want[2 * i]) and torch.equal(layer.values[0], want[2 * i + 1])
    ld.close()


def test_new_dynamic_cache_is_what_the_constructor_makes():
    from transformers import DynamicCache, LlamaConfig, MistralConfig

    small = dict(num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2)

    def shape(cache):
        return type(cache), {k: v for k, v in vars(cache).items() if k != "layers"}, \
            [(type(layer), vars(layer)) for layer in cache.layers]
    for cfg in (LlamaConfig(**small), MistralConfig(sliding_window=64, **small)):
        want = shape(DynamicCache(config=cfg))
        first, again = new_dynamic_cache(cfg), new_dynamic_cache(cfg)  # the second is the remembered path
        assert shape(first) == want and shape(again) == want
        assert again.layers[0] is not first.layers[0]  # fresh layers every time
    assert [type(layer).__name__ for layer in new_dynamic_cache(MistralConfig(sliding_window=64, **small)).layers] \
        == ["DynamicSlidingWindowLayer"] * 3
    assert type(new_dynamic_cache(None)) is DynamicCache and not new_dynamic_cache(None).layers


@pytest.mark.parametrize("compression", ["bf16", "fp8"])
def test_dequantized_gives_any_block_range_as_to_dynamic_cache_does(tmp_path, bf16_model, compression):
    model, cfg = bf16_model
    ids = prompt(4 * BS + 2, seed=5)
    loader = loader_for(tmp_path, compression, model, ids[: 4 * BS])
    hit = loader.lookup(ids)
    whole = hit.to_dynamic_cache("cpu", torch.bfloat16, model_config=cfg)
    part = hit.dequantized(torch.bfloat16, first_block=1, tokens=2 * BS + 5)  # ends inside block 3
    assert len(part) == 4
    for layer in range(2):
        assert torch.equal(part[2 * layer], whole.layers[layer].keys[0][:, BS : 3 * BS + 5])
        assert torch.equal(part[2 * layer + 1], whole.layers[layer].values[0][:, BS : 3 * BS + 5])
    with pytest.raises(ValueError, match="outside this hit"):
        hit.dequantized(torch.bfloat16, first_block=3, tokens=2 * BS)
    hit.release()
    loader.close()


@pytest.mark.parametrize("compression", ["bf16", "fp8"])
@pytest.mark.parametrize("native", [True, False])
def test_a_share_of_layers_and_heads_is_that_slice_of_the_whole(tmp_path, bf16_model, compression, native,
                                                                monkeypatch):
    import store.kernels.table

    if not native:  # the per-part path: views of the share's heads (what a GPU-bound hit stages)
        monkeypatch.setattr(store.kernels.table, "_native", None)
    model, _ = bf16_model
    ids = prompt(3 * BS + 2, seed=6)
    loader = loader_for(tmp_path, compression, model, ids[: 3 * BS])
    hit = loader.lookup(ids)
    whole = hit.dequantized(torch.bfloat16, first_block=1, tokens=BS + 3)
    share = hit.dequantized(torch.bfloat16, first_block=1, tokens=BS + 3, layers=[1], heads=slice(1, 2))
    assert [tuple(t.shape) for t in share] == [(1, BS + 3, whole[0].shape[2])] * 2
    assert torch.equal(share[0], whole[2][1:2]) and torch.equal(share[1], whole[3][1:2])
    backwards = hit.dequantized(torch.bfloat16, layers=[1, 0])
    assert torch.equal(backwards[0], hit.dequantized(torch.bfloat16)[2])
    for bad in (dict(layers=[0, 0]), dict(layers=[2]), dict(heads=slice(0, 3)), dict(heads=slice(0, 2, 2))):
        with pytest.raises(ValueError, match="not (distinct layers|a range)"):
            hit.dequantized(torch.bfloat16, **bad)
    hit.release()
    loader.close()
