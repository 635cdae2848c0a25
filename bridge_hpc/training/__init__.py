"""Training core: a Megatron-Bridge-compatible ``pretrain(config, forward_step_func)`` on megatron-core.

Import the pieces from their modules (``bridge_hpc.training.config`` has no torch dependency and
is safe on a login node); this package file imports nothing heavy on purpose.
"""
