"""Storage tiers and the ``Store`` over them: the tier interface and its capabilities (``base``), the
registry of tiers by URL scheme (``registry``), the NVMe tier (``local``, with its index ``index`` over
``sqlite`` and its metadata area ``metadir``), the S3 tier (``s3``, sealed with ``crypto``), the tiered,
tenant-isolated ``Store`` (``store``), its counters (``stats``), and housekeeping (``maintenance``)."""
