"""Storage tiers and the ``Store`` over them: the tier interface (``base``), the NVMe tier
(``local``, with its index ``index`` over ``sqlite``), the S3 tier (``s3``, sealed with ``crypto``),
the tiered, tenant-isolated ``Store`` (``store``), and housekeeping (``maintenance``)."""
