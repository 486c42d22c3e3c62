"""Build the one optional native module; everything else is in pyproject.toml.

``store.kernels._fp8gather`` (store/kernels/_fp8gather.c) speeds up FP8 dequantisation on the CPU.
It is optional: without a C compiler the install still succeeds and store.kernels.dequant
uses numpy instead (same bits, slower).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("store.kernels._fp8gather", ["store/kernels/_fp8gather.c"], optional=True,
                             extra_compile_args=["-O3", "-ffp-contract=off"])])
