"""bridge_hpc: a Slurm-native batch toolkit for training large models on preemptible clusters.

The login-node side (``bridge-submit``, ``bridge-status``, ``bridge-cluster``, ``bridge-report``) never
imports torch, megatron or nvidia_resiliency_ext; the training core (``bridge_hpc.training``) runs on
the ranks.
"""

__version__ = "0.1.0"
