"""The snapshot file format: precision (``precision``), the self-describing header (``header``),
the payload layout (``payload``, ``runs``), writing (``encode``) and reading (``snapshot``) one snapshot."""
