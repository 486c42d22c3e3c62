"""Tensor kernels: FP8 dequantisation on the read path (``dequant``, by table: ``table`` and the optional
native module ``_fp8gather``), host staging (``staging``) and recycled output memory (``memory``); and the
batched device kernels of the vLLM connector, write-back's gather and quantise (``gather``) and a device
load's dequantise and scatter (``scatter``)."""
