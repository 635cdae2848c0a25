"""bridge_hpc.training.process.compiler_imports: torch's compiler imported at a compiled function's
first call, not when it is decorated; torch's own decorators back afterwards."""

from __future__ import annotations

import subprocess
import sys
import textwrap

#: Runs in a fresh interpreter: only there is it known that nothing imported dynamo before.
SCRIPT = textwrap.dedent("""
    import sys, torch, torch.compiler
    from bridge_hpc.training.process import compiler_imports

    compile_before, disable_before = torch.compile, torch.compiler.disable
    with compiler_imports.deferred():
        @torch.compile(backend="eager")
        def scaled(x):
            return x * 2 + 1

        @torch.compile
        def shifted(x):
            return x - 1

        @torch.compiler.disable
        def untraced(x):
            return x + 10

        class Layer:
            @torch.compiler.disable(reason="a method")
            def forward(self, x):
                return x * 5

    assert "torch._dynamo" not in sys.modules and "torch._inductor" not in sys.modules, "decorating imported them"
    assert torch.compile is compile_before and torch.compiler.disable is disable_before, "not restored"
    assert scaled.__name__ == "scaled" and untraced._torchdynamo_disable and Layer.forward._torchdynamo_disable
    x = torch.ones(2)
    assert torch.equal(untraced(x), x + 10) and torch.equal(Layer().forward(x), x * 5)
    assert torch.equal(scaled(x), x * 3)  # compiled now, at its first call
    assert "torch._dynamo" in sys.modules
    assert torch.equal(scaled(x + 1), (x + 1) * 2 + 1)

    def outer(y):  # a compiled region calling a disabled stand-in runs it eagerly
        return untraced(y) * 3
    assert torch.equal(torch.compile(outer, backend="eager")(x), (x + 10) * 3)
    print("ok")
""")

NOT_FUNCTIONS = textwrap.dedent("""
    import torch, torch.compiler
    from bridge_hpc.training.process import compiler_imports

    with compiler_imports.deferred():
        module = torch.compile(torch.nn.Linear(2, 2), backend="eager")
        def f(x):
            return x
        nonrecursive = torch.compiler.disable(f, recursive=False)
    assert type(module).__name__ == "OptimizedModule", type(module)
    assert getattr(nonrecursive, "_torchdynamo_disable_recursive", None) is False
    print("ok")
""")


def _run(script: str) -> None:
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr[-4000:]


def test_decorated_functions_import_the_compiler_only_when_first_called():
    _run(SCRIPT)


def test_modules_and_non_recursive_disables_go_to_torch_at_once():
    _run(NOT_FUNCTIONS)


#: ``bridge-hf import`` in a fresh interpreter: megatron-core imported, torch's compiler not
#: (``compile_fx``: what ``torch.compile``'s decoration imports; the checkpoint's writing looks dynamo
#: up itself, through torch's ``get_model_state_dict``).
HF_IMPORT = textwrap.dedent("""
    import sys
    from bridge_hpc.cli import hf

    assert hf.main(["import", *sys.argv[1:]]) == 0
    assert "megatron.core" in sys.modules, "megatron-core was not imported: nothing was deferred"
    assert "torch._inductor.compile_fx" not in sys.modules, "the conversion imported torch's compiler"
    print("ok")
""")


def test_bridge_hf_import_imports_megatron_without_torchs_compiler(tmp_path):
    """``bridge-hf import`` imports megatron-core inside :func:`compiler_imports.deferred`, as the ranks
    do: the decorations of megatron-core's fused functions no longer import torch's compiler (about 2 s
    of CPU of each import on this 2-core machine)."""
    from hf_models import make_hf_model

    make_hf_model("qwen2", str(tmp_path / "hf"))
    proc = subprocess.run([sys.executable, "-c", HF_IMPORT, str(tmp_path / "hf"), str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr[-4000:]
