"""torch's compiler imported when a compiled function is first called, not when it is decorated.

megatron-core decorates functions at import time with ``torch.compile`` (its ``jit_fuser``: the
fused bias-GeLU/GeGLU/SwiGLU kernels, the MoE router) and ``torch.compiler.disable`` (megatron_fsdp).
Each of these calls imports ``torch._dynamo`` and ``torch._inductor`` on the spot, although
compilation itself only happens at the first call: 2.2 s of the 4-5.8 s a requeued rank spent in its
imports on an H100 host (benchmarks/results/device-2026-11-27c), paid at every preemption even by a
model that never calls one of those functions (one with the fusions off). Deferred, importing the
training core took 3.0-4.3 s instead of 4.7-5.8 s there (2026-11-27, in-process, 2 runs each).

:func:`deferred`, around the rank's imports of the training code (``bridge_hpc.rank``),
replaces both decorators for that time with ones that return a stand-in, and restores torch's own
afterwards. The stand-in applies torch's decorator to the function the first time it is called and
calls the result from then on, so a model that uses a fused function compiles it then, as before,
and pays the compiler's imports then instead. Only plain functions are deferred; anything else (an
``nn.Module``, a non-recursive ``disable``) goes to torch's decorator at once. A function deferred
from ``torch.compiler.disable`` carries the attributes dynamo reads to leave a disabled function
untraced, so inside a compiled region it is still run eagerly.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from typing import Any, Callable, Iterator


def _stand_in(apply: Callable[[], Callable], function: Callable) -> Callable:
    """``function``'s stand-in: on its first call ``apply()`` gives the decorated function, which
    this and every later call runs."""
    lock = threading.Lock()
    decorated: list = []

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not decorated:
            with lock:
                if not decorated:
                    decorated.append(apply())
        return decorated[0](*args, **kwargs)

    return call


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """While inside, ``torch.compile`` and ``torch.compiler.disable`` defer their work (and their
    imports of dynamo and inductor) on plain functions to the function's first call."""
    import torch
    import torch.compiler

    compile_now, disable_now = torch.compile, torch.compiler.disable

    def compile_later(model: Any = None, **options: Any) -> Any:
        if model is None:  # @torch.compile(...) with options: the decorator comes first
            return lambda function: compile_later(function, **options)
        if not inspect.isfunction(model):
            return compile_now(model, **options)
        return _stand_in(lambda: compile_now(model, **options), model)

    def disable_later(fn: Any = None, recursive: bool = True, **options: Any) -> Any:
        if fn is None:
            return lambda function: disable_later(function, recursive, **options)
        if not inspect.isfunction(fn) or not recursive:
            return disable_now(fn, recursive, **options)
        stand_in = _stand_in(lambda: disable_now(fn, recursive, **options), fn)
        # What torch._dynamo.disable marks its result with: a compiled region that calls the stand-in
        # runs it eagerly instead of tracing into it.
        stand_in._torchdynamo_disable = True  # type: ignore[attr-defined]
        stand_in._torchdynamo_disable_recursive = True  # type: ignore[attr-defined]
        stand_in._torchdynamo_disable_msg = options.get("reason")  # type: ignore[attr-defined]
        return stand_in

    torch.compile, torch.compiler.disable = compile_later, disable_later
    try:
        yield
    finally:
        torch.compile, torch.compiler.disable = compile_now, disable_now
