"""bridge-prepare-data: jsonl text to megatron-core indexed datasets, locally or as a Slurm array.

Login node and batch tasks; torch and megatron-core only inside the functions that tokenize.
"""
