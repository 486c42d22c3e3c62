"""Tensor kernels of the read path: FP8 dequantisation (``dequant``, by table: ``table`` and the
optional native module ``_fp8gather``), host staging (``staging``) and recycled output memory (``memory``)."""
