"""bridge_hpc.training.process.lazy_imports: W&B, which megatron-core imports at its own import, loaded at
its first use; the real package in its place from then on. Each case runs in a fresh interpreter: only
there is it known that nothing imported the package before."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("wandb")


def _run(script: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_the_rank_imports_megatron_core_without_loading_wandb_and_wandb_works_at_first_use():
    out = _run("""
        import sys
        from bridge_hpc.training.process import compiler_imports, heap, lazy_imports

        assert lazy_imports.install() == ["wandb"]
        stand_in = sys.modules["wandb"]
        with heap.imports_uncollected(), compiler_imports.deferred():  # as bridge_hpc.rank imports them
            from bridge_hpc.training.pretrain import pretrain  # noqa: F401 - megatron-core with it
            import megatron.core.timers as timers
        assert "megatron.core" in sys.modules
        assert timers.wandb is stand_in  # megatron-core bound the stand-in
        assert "wandb.sdk" not in sys.modules and sys.modules["wandb"] is stand_in, "wandb was loaded"
        print("file", stand_in.__file__.endswith("__init__.py"))

        import wandb
        version = wandb.__version__  # the first use: the real package is imported
        real = sys.modules["wandb"]
        assert real is not stand_in and type(real).__name__ == "module" and "wandb.sdk" in sys.modules
        assert timers.wandb.init is real.init  # what megatron-core holds reads the real package
        print("version", version == real.__version__)
    """)
    assert "file True" in out and "version True" in out


def test_a_submodule_import_runs_the_package_first_and_a_missing_package_gets_no_stand_in():
    out = _run("""
        import sys
        from bridge_hpc.training.process import lazy_imports

        assert lazy_imports.install(["bridge_no_such_package", "wandb"]) == ["wandb"]
        assert "bridge_no_such_package" not in sys.modules
        assert lazy_imports.install() == []  # already there: left alone
        import wandb.sdk  # the parent's own import runs before its submodule, as without the stand-in
        assert type(sys.modules["wandb"]).__name__ == "module" and hasattr(sys.modules["wandb"], "init")
        print("ok")
    """)
    assert "ok" in out
