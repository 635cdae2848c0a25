"""Profiling names of Megatron Bridge's ``bridge.training.profiling`` that the seed pages use in signatures.

``TNvtxContext`` is the type of the NVTX context an nsys profile runs under (Bridge's
``post_training_step_callbacks(..., nsys_nvtx_context: Optional[TNvtxContext])``): torch's
``emit_nvtx``, whose ranges nsys records. This toolkit's profiler window is torch's profiler
(``profiling.use_pytorch_profiler``, see :func:`bridge_hpc.training.train._start_profiler`); it starts
no nsys context itself, so the loop passes None where Bridge would pass one.
"""

from __future__ import annotations

import torch.autograd.profiler

#: The NVTX context manager type (Bridge: ``torch.autograd.profiler.emit_nvtx``).
TNvtxContext = torch.autograd.profiler.emit_nvtx
