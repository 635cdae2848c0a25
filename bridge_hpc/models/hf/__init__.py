"""Hugging Face checkpoints in and out, as tools (``bridge-hf``; one process, torch):

- :mod:`.convert` (``bridge-hf import``): a Hugging Face folder -> a toolkit checkpoint;
- :mod:`.export` (``bridge-hf export``): a toolkit checkpoint at any layout -> a Hugging Face folder.

What the ranks and the job file's loader read of a Hugging Face folder (config.json, the headers, the
mapping, each rank's slices) lives a floor below, in :mod:`bridge_hpc.training.hf`: the tools import
it, the training package never imports these.
"""
