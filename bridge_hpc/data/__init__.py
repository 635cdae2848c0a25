"""Data preparation: raw text to megatron-core indexed datasets (``bridge-prepare-data``).

Runs on a login or compute node without GPUs; torch and megatron-core are imported only inside the
functions that write the files.
"""
