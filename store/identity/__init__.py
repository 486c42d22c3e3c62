"""Identity: what names a block of KV. Block keys (``keys``), tenants and their salts (``tenant``),
and the model fingerprints that root every key (``fingerprint``)."""
