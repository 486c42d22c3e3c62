"""The sections of kvwarm's configuration file (``kv_cache``, ``store``, ``loader``, ``fleet_memory``,
``monitoring``, ``tenants.<name>``): one frozen pydantic model each, checked field by field.

Values are checked strictly: a YAML ``true`` is not the number 1, a quoted ``"8"`` is not a number,
and an integer is a float's value but never the other way round. No float is ``inf`` or ``nan``,
no size is 0 bytes, and a list in the file is a tuple field's value.

:mod:`store.config` puts them together into :class:`store.config.KvwarmConfig` and reads files;
the field descriptions are the configuration reference (``docs/generate.py``).
"""
from __future__ import annotations

import os
import re
import typing
from typing import Annotated, Any, Literal, Optional

from annotated_types import Ge
from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from store.errors import ConfigError
from store.format.precision import Precision
from store.tiers.urls import check_store_url


class _Section(BaseModel):
    # strict: a bool is never a number and a string never a number or a bool (YAML's `true`, a quoted "8");
    # an int is still a float's value. allow_inf_nan: no TTL, rate or price is inf or nan.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _lists_are_tuples(cls, data: Any) -> Any:
        """YAML, JSON and TOML have lists, not tuples: a list is a tuple field's value (strict mode
        takes only a tuple); its items are still checked strictly."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: tuple(v) if isinstance(v, list) and k in fields and _takes_tuple(fields[k].annotation) else v
                for k, v in data.items()}


def _takes_tuple(ann: Any) -> bool:
    """Whether a field's annotation is a tuple, or a union with one (``Optional[tuple[str, ...]]``)."""
    return typing.get_origin(ann) is tuple or any(typing.get_origin(a) is tuple for a in typing.get_args(ann))


#: a size in bytes, an integer or a string with a unit ('64GiB', '2GB'); never 0
Bytes = Annotated[ByteSize, Ge(1)]


class KvCacheConfig(_Section):
    """What is cached and how. ``reuse_strategy`` never allows serving KV across prefixes."""

    reuse_strategy: Literal["exact_prefix", "similarity"] = Field(
        "exact_prefix",
        description="Serving always reuses KV for an exact token prefix only. 'similarity' makes mining "
        "group near-duplicate prompts (MinHash LSH) to find their shared prefix; it never hands a "
        "request KV computed for different tokens.",
    )
    similarity_threshold: float = Field(
        0.85, ge=0.5, le=1.0,
        description="Jaccard threshold of the MinHash LSH that groups prompts into families while mining: the "
        "first run's. Later runs of a store adapt it between 0.7 and 0.95 by the last measured hit rate.",
    )
    max_shared_instances: int = Field(
        8, ge=1, le=1024,
        description="Serving processes on one node that may attach to the node's shared snapshot pool at once. "
        "It bounds the pool's bookkeeping, not tenants or requests; a process beyond it serves cold (misses "
        "with reason max_shared_instances) and retries every 5 s.",
    )
    compression: Literal["fp8", "bf16", "fp16", "fp32"] = Field(
        "fp8", description="Storage dtype of the KV. fp8 is e4m3 with fp32 scales; fp32 is lossless for fp32 "
        "models (4x the bytes of fp8: for exactness checks, not production).")
    scale_granularity: Literal["head", "head_group"] = Field(
        "head", description="FP8 scales per layer and kv head, or per kv head and group of group_tokens tokens.")
    group_tokens: int = Field(0, ge=0, description="Tokens per scale group; at least 1 with head_group.")
    keep_layers: tuple[int, ...] = Field(
        (0,), description="Layers stored unquantised (keep_dtype) when compression is fp8. Default [0]: layer 0 "
        "is where FP8 loses most (docs/concepts/precision.md); [] stores FP8 everywhere. Snapshots of "
        "different settings have different keys and never mix. Each layer once, counted from 0; a layer the model "
        "does not have is refused when the model is known (the prefill job, the vLLM connector).",
    )
    keep_dtype: Literal["bf16", "fp16"] = Field("bf16", description="Dtype of the keep_layers.")
    block_size: int = Field(256, ge=1, le=65536, description="Tokens per block, i.e. per snapshot file.")
    ttl_hours: float = Field(4.0, gt=0, description="Default lifetime of a snapshot; within the policy bounds.")
    ttl_min_hours: float = Field(2.0, gt=0, description="Shortest TTL allowed: shorter ones are clamped up "
                                 "(plan entries) or refused (explicit TTLs).")
    ttl_max_hours: float = Field(6.0, gt=0, description="Longest TTL allowed: longer ones are clamped down or "
                                 "refused. GC deletes S3 objects older than this.")

    @field_validator("keep_layers")
    @classmethod
    def _check_keep_layers(cls, layers: tuple[int, ...]) -> tuple[int, ...]:
        for i in layers:
            if i < 0:
                raise ValueError(f"layer {i} is not a layer: layers count from 0 (the first) to the model's layer "
                                 "count minus 1; list them as [0] or [0, 31], or [] for none")
        seen = [i for n, i in enumerate(layers) if i in layers[:n]]
        if seen:
            raise ValueError(f"layer {seen[0]} is listed twice: list each layer once")
        return layers

    @model_validator(mode="after")
    def _check(self) -> "KvCacheConfig":
        if self.ttl_min_hours > self.ttl_max_hours:
            raise ValueError(
                f"ttl_min_hours ({self.ttl_min_hours}) must not exceed ttl_max_hours ({self.ttl_max_hours})"
            )
        if not self.ttl_min_hours <= self.ttl_hours <= self.ttl_max_hours:
            raise ValueError(
                f"ttl_hours = {self.ttl_hours} is outside the policy bounds "
                f"[{self.ttl_min_hours}, {self.ttl_max_hours}] (ttl_min_hours, ttl_max_hours)"
            )
        if self.scale_granularity == "head_group" and self.group_tokens < 1:
            raise ValueError("scale_granularity = 'head_group' needs group_tokens >= 1")
        return self

    def precision(self) -> Precision:
        """The storage precision these settings describe."""
        return Precision(
            compression=self.compression,
            granularity=self.scale_granularity,
            group_tokens=self.group_tokens,
            keep_layers=tuple(self.keep_layers),
            keep_dtype=self.keep_dtype,
        )

    def ttl_seconds(self, hours: float | None = None) -> float:
        """A TTL in seconds, the default one or ``hours`` checked against the policy bounds."""
        h = self.ttl_hours if hours is None else hours
        if not self.ttl_min_hours <= h <= self.ttl_max_hours:
            raise ConfigError(
                f"ttl = {h} h is outside the policy bounds [{self.ttl_min_hours}, {self.ttl_max_hours}] h"
            )
        return h * 3600.0

    @property
    def ttl_max_s(self) -> float:
        """The longest TTL the policy allows, in seconds (what GC holds remote objects to)."""
        return self.ttl_max_hours * 3600.0

    def clamp_ttl(self, ttl_s: float | None) -> float:
        """A TTL in seconds clamped into the policy bounds (``ttl_min_hours`` .. ``ttl_max_hours``);
        the default TTL (``ttl_hours``) when none is given. The one clamp of plan and prefill TTLs."""
        if ttl_s is None:
            return self.ttl_seconds()
        return min(max(float(ttl_s), self.ttl_min_hours * 3600.0), self.ttl_max_s)


class S3Config(_Section):
    """How to reach the S3 tier (any S3-compatible endpoint)."""

    endpoint_url: Optional[str] = Field(
        None, description="Any S3-compatible endpoint (SeaweedFS, MinIO, Ceph...); none: AWS.")
    access_key_env: Optional[str] = Field(None, description="Env var holding the access key (else boto's chain).")
    secret_key_env: Optional[str] = Field(None, description="Env var holding the secret key (else boto's chain).")
    region: str = Field("us-east-1", description="The S3 region.")
    connect_timeout_s: float = Field(3.0, gt=0, description="botocore's connect timeout.")
    read_timeout_s: float = Field(10.0, gt=0, description="botocore's read timeout.")
    op_timeout_s: float = Field(
        30.0, gt=0, description="Hard ceiling on any one S3 call, retries included: an unreachable endpoint fails "
        "with StoreUnavailable after at most this long.")
    retries: int = Field(2, ge=0, le=10, description="Retries per S3 call.")


class StoreConfig(_Section):
    """Where snapshots live and how much room they may take."""

    url: str = Field(
        "file://~/.cache/kvwarm",
        description="Tiers, fastest first, comma-separated: 'file:///var/cache/kvwarm' alone, or "
        "'file:///var/cache/kvwarm,s3://bucket/prefix'. An s3:// URL alone adds the default local tier. A file:// "
        "directory is absolute (file:///path, three slashes) or under the home directory (file://~/path); an S3 "
        "bucket follows S3's naming rules (3-63 characters of a-z 0-9 . -) and its prefix has no '.', '..' or empty "
        "segments.",
    )
    nvme_cap: Bytes = Field(ByteSize(64 << 30), description="Hard ceiling on the local tier's bytes (snapshots "
                               "plus writes in flight), e.g. '64GiB', '2GB' or bytes.")
    recency_flush_s: float = Field(5.0, ge=0, description="Readers record accesses in memory and write them to the "
                                   "index at most this often (LRU without a disk write per read).")
    evict_to_fraction: float = Field(0.9, gt=0, le=1.0, description="When a write does not fit, evict (expired "
                                     "first, then least recently used) down to this fraction of the cap.")
    s3: S3Config = Field(S3Config(), description="How to reach the S3 tier.")

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str) -> str:
        try:
            return check_store_url(url)
        except ConfigError as exc:  # the formatter names the key already
            raise ValueError(str(exc).removeprefix("store.url: ")) from None


class LoaderConfig(_Section):
    """Serving-side loader defaults (``store.serving.loader.KVLoader`` keywords override them)."""

    pool_bytes: Bytes = Field(ByteSize(8 << 30), description="Most snapshot bytes a node keeps mapped, e.g. '16GiB'.")
    pool_dir: Optional[str] = Field(None, description="Where the node pool's state lives (default under /dev/shm).")
    fetch_mode: Literal["background", "sync"] = Field(
        "background", description="NVMe miss with an S3 hit: answer miss now and fetch for next time, or wait.")
    sync_fetch_timeout_s: float = Field(2.0, gt=0, description="Most a lookup waits for S3 in sync mode.")
    s3_backoff_s: float = Field(30.0, ge=0, description="After S3 fails, do not ask it again for this long.")
    verify_payload: bool = Field(True, description="Check payload checksums when a snapshot enters the pool.")
    fetch_workers: int = Field(2, ge=1, le=64, description="Background fetch threads: S3 to NVMe for a lookup's "
                               "NVMe miss (prefetch has its own prefetch_streams).")
    chain_gets: int = Field(
        8, ge=1, le=64, description="S3 GETs one lookup's fetch of a chain has in flight at once (sync and background "
        "fetches): the blocks are read in parallel and written into NVMe in prefix order, so a block is visible only "
        "after its parents; GETs made past the chain's first missing block are discarded. At most chain_gets x "
        "(fetch_workers + 1) GETs per loader. A prefetch stream copies one block at a time (prefetch_streams are "
        "its parallel GETs).")
    prefetch_streams: int = Field(
        8, ge=1, le=64, description="Chains a prefetch copies from S3 at once (parallel GETs), on threads of their "
        "own; each chain block by block in prefix order, the plan's first entries first. S3 gives far more "
        "bandwidth to parallel GETs than to one stream.")
    dequant: Literal["table", "compiled", "auto"] = Field(
        "table", description="CPU FP8 dequantiser: table (per-head tables; the native gather where it was built, "
        "numpy otherwise), compiled (torch.compile), or auto (the native table where built, else the numpy "
        "table until the compiled kernel is ready).")
    public_prefixes: bool = Field(
        True, description="Also look up prefixes prefilled for tenant 'public' (shared system prompts) and keep "
                          "the longer hit.")
    staging_bytes: Annotated[ByteSize, Ge(2)] = Field(
        ByteSize(64 << 20), description="Most pinned host memory a process keeps for moving stored KV to a GPU "
        "(two slots used in turn; a larger load goes through in pieces), e.g. '64MiB'. The slots are freed after "
        "30 s without a transfer.")
    device_scratch_bytes: Annotated[ByteSize, Ge(1 << 20)] = Field(
        ByteSize(256 << 20), description="Device memory each vLLM worker reserves once, on its GPU, for every "
        "temporary of its loads (stored bytes, fp32 dequantisation) and of its write-back (gathered blocks, fp32 "
        "quantisation, FP8 bytes before their copy to the host), e.g. '256MiB'. Larger work goes through in chunks "
        "of blocks, so device memory stays bounded at any context length. vLLM does not count it: take it out of "
        "--gpu-memory-utilization (docs/guides/engines.md has the arithmetic).")
    warm_up_tokens: int = Field(
        2048, ge=0, le=1 << 20, description="At an engine worker's start, its loaders run one load of this many tokens "
        "on a synthetic block, so that a first load of about this size (up to 1.25x smaller) pays no one-off costs; "
        "the CPU gather's output memory stays held for reuse. 0: one block.")
    write_back_queue_bytes: Bytes = Field(
        ByteSize(2 << 30), description="Most bytes of blocks the vLLM connector has stored out of its cache for "
        "write-back (quantised where the cache lives: the stored bytes and scales, in pinned host memory on a GPU) "
        "and not yet written; a save that does not fit keeps its leading kvwarm blocks that do, and the rest is "
        "dropped and counted. Give it at least one engine step's prompt KV as stored: max_num_batched_tokens x "
        "layers x 2 x KV heads x head dim x 1 byte for FP8 (0.5 GiB for an 8B model at 8,192 tokens; twice that "
        "for bf16 storage). Blocks read back from NVMe for their S3 upload are bounded apart by the same number of "
        "bytes (so write-back holds at most twice this); the others wait in the node's upload backlog, on NVMe.")
    write_back_streams: int = Field(
        4, ge=1, le=64, description="Threads the vLLM connector's write-back uploads to S3 on (parallel PUTs); "
        "blocks go to NVMe first, on the writer's own thread, and wait in the node's persistent upload backlog "
        "until a thread takes them, most valuable first.")
    write_back_via: Literal["node", "engine"] = Field(
        "engine", description="Who writes the vLLM connector's write-back blocks to NVMe and S3. node: each engine "
        "worker hands every block (quantised where the cache lives) to the machine's node process through a "
        "shared-memory ring of its own (one memcpy per stored tensor, never waiting: a full ring drops the save's "
        "rest, counted write_back_dropped:ring_full), and the node writes it and makes the S3 uploads; while no node "
        "takes the ring (none, refused, killed) the engine writes the blocks itself, and its upload threads start "
        "then. engine: the engine's own writer thread and upload threads do it all.")
    write_back_ring_bytes: Bytes = Field(
        ByteSize(256 << 20), description="Size of each engine worker's write-back ring under /dev/shm "
        "(loader.write_back_via = node), e.g. '256MiB': the blocks handed to the node and not yet written. Give it "
        "at least one engine step's prompt KV as stored (see write_back_queue_bytes).")

    def with_overrides(self, **given: Any) -> "LoaderConfig":
        """This section with each keyword that is not ``None`` in place of its value, validated
        as the config file's values are (``KVLoader``'s keywords).

        Raises:
            ConfigError: one line per bad keyword: ``loader.key = value: what is allowed``.
        """
        from store.config import _format_errors  # the file's error format (store.config imports this module)

        update = {k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in given.items() if v is not None}
        try:
            return LoaderConfig.model_validate({**self.model_dump(), **update})
        except ValidationError as exc:
            raise ConfigError(_format_errors(exc, "KVLoader keywords").replace("\n  ", "\n  loader.")) from None


#: what a node id may be: it names a file in every tier (a hostname or a pod name fits)
NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


class FleetMemoryConfig(_Section):
    """What a serving node records of the blocks it serves, for nodes that start later (fleet memory)."""

    enabled: bool = Field(
        True, description="Record which blocks this node served and when, and write it to every tier's metadata "
        "area (fleet/<namespace>/<node_id>.json), so that a new or replaced node can warm from what the fleet "
        "was serving. Only salted block names are written, never prompts or token ids.")
    node_id: Optional[str] = Field(
        None, description="This node's name in the fleet's records (1-128 characters of A-Z a-z 0-9 _ . -). "
        "$KVWARM_NODE_ID, when set, comes first; with neither, the host name. Keep it stable across restarts of the "
        "same node (a restart continues its own record) and give each engine process on a host its own.")
    window_s: float = Field(
        3600.0, gt=0, description="How far back a node's record reaches: a block unused for longer is dropped "
        "at the next flush.")
    flush_s: float = Field(
        30.0, gt=0, description="A node writes its record at most this often (one write per namespace and tier).")
    max_names: int = Field(
        50_000, ge=1, le=10_000_000, description="Most blocks a node remembers per namespace; past it the least "
        "recently used are dropped. Each name costs about 270 bytes of memory and 80 bytes of file: 50,000 "
        "names are about 14 MB and a 4 MB file per namespace, more blocks than a 64 GiB local tier holds "
        "for any model of 0.5B parameters or more at block_size 256 (docs/reference/fleet.md).")
    max_file_bytes: int = Field(
        8 << 20, ge=64 << 10, le=1 << 30, description="Largest fleet file a node reads or writes, in bytes. A "
        "reader skips (and counts) a larger file without reading it into memory; a writer leaves out its least "
        "recently used names to stay under it. The default holds about 100,000 names: twice max_names' default.")

    @field_validator("node_id")
    @classmethod
    def _check_node_id(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and not NODE_ID.fullmatch(value):
            raise ValueError("use 1-128 characters of A-Z a-z 0-9 _ . -, starting with a letter or digit")
        return value


class AgentConfig(_Section):
    """The serving node's agent (``store.serving.agent``): it follows the published plan for the
    node's life and warms a new node from the fleet's memory."""

    poll_s: float = Field(30.0, gt=0, description="How often the node checks the published plan's version (a few "
                          "bytes); the plan is read only when it changed. The pipeline publishes every 5 minutes.")
    fleet_warmup: bool = Field(True, description="Warm from the fleet's memory: the blocks the fleet's nodes served "
                               "recently (fleet_memory), ranked with the plan's forecast.")
    fleet_window_s: float = Field(3600.0, gt=0, description="How far back the fleet's records count.")
    min_value: float = Field(0.02, ge=0, lt=1, description="The least chance of use a copy must keep once it "
                             "lands (after the copies queued before it) to be queued at all.")
    link_bytes_per_s: float = Field(
        7.0e8, gt=0, description="The node's read rate from the shared (S3) tier, which sizes the warm-up to what "
        "can land before it is needed. Default: AWS's guidance of 85-90 MB/s per S3 connection, times the 8 "
        "prefetch_streams.")


class NodeConfig(_Section):
    """The kvwarm node process (``prefill node``): one per machine, shared by its engines (docs/guides/node.md)."""

    socket: Optional[str] = Field(
        None, description="The node's Unix socket. Default: $XDG_RUNTIME_DIR/kvwarm/node.sock where that variable "
        "is set, else node.sock under kvwarm's home ($KVWARM_HOME, else ~/.cache/kvwarm). At most 100 bytes long.")
    autostart: bool = Field(
        True, description="A client (the vLLM connector, a KVLoader) that finds no node at the socket starts one "
        "itself, detached, with this configuration (one at a time: a lock beside the socket).")
    autostart_idle_s: Optional[float] = Field(
        900.0, gt=0, description="A node a client started exits after this many seconds with no client connected "
        "(long enough to outlive an engine's restart); null: it serves until stopped. A node run by `prefill node` "
        "serves until stopped unless given --exit-idle.")
    metrics_port: Optional[int] = Field(
        9477, ge=0, le=65535, description="The node's Prometheus endpoint (http://0.0.0.0:PORT/metrics); 0 picks a "
        "free port (reported by the node's stats), null serves none. A port in use is logged and the node runs "
        "without one.")
    gc_interval_s: float = Field(
        600.0, gt=0, description="How often the node collects the node tier's garbage (expired snapshots, anything "
        "over store.nvme_cap, crash leftovers).")
    agent: bool = Field(
        True, description="Run the node agent: follow the plans the pipeline publishes to the store and warm from "
        "the fleet's memory, for every namespace the plans and the configured tenants name.")


class MonitoringConfig(_Section):
    """Prices for the economics family of ``prefill report`` and the flows' report."""

    gpu_price_per_hour: Optional[float] = Field(
        None, ge=0, description="Price of one GPU-hour (any currency) for prefill cost per 1,000 requests.")
    prefill_tokens_per_s: Optional[float] = Field(
        None, gt=0, description="Prefill rate to value saved tokens at (default: the rate the run's prefill measured).")


class TenantConfig(_Section):
    """Where a tenant's secrets come from (never the secrets themselves)."""

    secret_env: Optional[str] = Field(
        None, description="Env var holding the tenant's salt secret: at least 16 characters (generate one with "
        "`openssl rand -hex 32`). The tenant's salt is scrypt of it (docs/concepts/tenants.md).")
    encryption_key_env: Optional[str] = Field(
        None, description="Env var holding a hex 32-byte AES-GCM key: S3 objects are encrypted at rest."
    )
    writer_secret_env: Optional[str] = Field(
        None, description="tenants.public only: env var holding the operator's public-writer credential. The "
        "first public write that holds it records a slow hash of it in each tier's public owner record; from then "
        "on every public write or delete there needs it. Set it where the prefill job writes public prefixes; "
        "serving nodes only read public KV and need no credential (docs/concepts/tenants.md).")
    cache_salts: tuple[str, ...] = Field(
        (), description="vLLM cache_salt values whose requests are this tenant's (the KV connector maps a "
        "request's cache_salt to its tenant through these), each at least 16 characters. They are secrets: "
        "prefer cache_salts_env or cache_salts_file, which keep them out of this file.")
    cache_salts_env: Optional[str] = Field(
        None, description="Env var holding more of the tenant's cache_salts, comma-separated (merged with "
        "cache_salts and cache_salts_file).")
    cache_salts_file: Optional[str] = Field(
        None, description="A file of more of the tenant's cache_salts, one a line (blank lines and lines "
        "starting with # ignored; merged with cache_salts and cache_salts_env). Read when an engine starts.")
