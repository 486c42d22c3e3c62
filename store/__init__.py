"""kvwarm's snapshot store: what prefill jobs write and serving nodes read.

Public face (import from the modules; nothing is imported here, so a serving node
pays only for what it uses):

- ``store.identity.keys``: ``KeyRoot``, ``block_chain``, ``block_keys``, ``root_key``, ``chain_key``
- ``store.format.precision``: ``Precision``, ``quantize``, ``dequantize``
- ``store.format.snapshot``: ``build_snapshot``, ``read_snapshot``, ``Snapshot``, ``EncodedSnapshot``
- ``store.tiers.store``: ``Store`` (tiered, tenant-isolated), ``Probe``, ``Read``; ``store.tiers.registry``:
  ``tiers_from_url``, ``TIERS`` (a tier per URL scheme); ``store.miss``: ``MissReason``
- ``store.identity.tenant``: ``Tenant``, ``PUBLIC``
- ``store.config``: ``load_config``, ``KvwarmConfig``
- ``store.tiers.maintenance``: ``verify``, ``gc``
- ``store.errors``: ``KvwarmError`` (every project error's base), its two kinds ``BadInputError`` (CLI exit 2)
  and ``OperationalError`` (exit 1), and ``StoreError`` and its subclasses
- ``store.identity.fingerprint``: ``ModelIdentity``, ``identity_from_dir`` (fingerprints from model files)
- ``store.plan``: ``Plan``, ``PlanEntry``, ``read_plan``, ``write_plan`` (the prewarm plan file)
- ``store.published_plan``: ``PublishedPlan``, ``key_plan``, ``publish_plan``, ``latest_plan`` (the plan
  serving nodes read: block keys, no prompts)
- ``store.serving.loader``: ``KVLoader``, ``LoaderHit`` (the serving side; see docs/guides/loader.md)
- ``store.serving.pool``: ``SnapshotPool`` (the node-wide shared pool); ``store.kernels.dequant``: dequantisers;
  ``store.engines.paged``: contiguous and paged-cache copies; ``store.serving.metrics``: ``LoaderMetrics`` (Prometheus)
"""
