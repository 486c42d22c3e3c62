"""kvwarm's snapshot store: what prefill jobs write and serving nodes read.

Public face (import from the modules; nothing is imported here, so a serving node
pays only for what it uses):

- ``store.keys``: ``KeyRoot``, ``block_chain``, ``block_keys``, ``root_key``, ``chain_key``
- ``store.precision``: ``Precision``, ``quantize``, ``dequantize``
- ``store.snapshot``: ``build_snapshot``, ``read_snapshot``, ``Snapshot``, ``EncodedSnapshot``
- ``store.store``: ``Store`` (tiered, tenant-isolated), ``Probe``
- ``store.tenant``: ``Tenant``, ``PUBLIC``
- ``store.config``: ``load_config``, ``KvwarmConfig``
- ``store.maintenance``: ``verify``, ``gc``
- ``store.errors``: ``StoreError`` and its subclasses
- ``store.identity``: ``ModelIdentity``, ``identity_from_dir`` (fingerprints from model files)
- ``store.plan``: ``Plan``, ``PlanEntry``, ``read_plan``, ``write_plan`` (the prewarm plan file)
- ``store.loader``: ``KVLoader``, ``LoaderHit`` (the serving side; see docs/loader.md)
- ``store.pool``: ``SnapshotPool`` (the node-wide shared pool); ``store.dequant``: dequantisers;
  ``store.paged``: contiguous and paged-cache copies; ``store.metrics``: ``LoaderMetrics`` (Prometheus)
"""
