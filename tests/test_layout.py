"""The package's sides and their dependency direction, read from the source (no imports run).

cli -> launch / report / local_slurm -> slurm -> contracts, and training -> slurm -> contracts;
cli -> data -> the torch-free training config and tokenizer builder (bridge-prepare-data);
contracts imports nothing of ours; the login side imports no torch at module level; no cycles.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Set

PACKAGE = Path(__file__).resolve().parent.parent / "bridge_hpc"

#: side -> the sides it may import (besides itself). launch may read the torch-free training config.
ALLOWED = {
    "contracts": set(),
    "slurm": {"contracts"},
    "training": {"contracts", "slurm", "report", "launch"},
    "launch": {"contracts", "slurm", "training"},
    "report": {"contracts"},
    "local_slurm": {"contracts"},
    "cli": {"contracts", "slurm", "launch", "report", "local_slurm", "data", "training"},
    "data": {"contracts", "training"},
}
#: Modules the login node imports; each may import torch only inside functions (the ranks' code).
TORCH_FREE = ("contracts", "launch", "slurm", "report", "local_slurm", "cli", "data", "training.config",
              "training.signal_recorder", "training.tokenizers")


#: The training modules that data preparation (cli, data) may import: torch-free at module level.
TORCH_FREE_TRAINING = ("bridge_hpc.training.config", "bridge_hpc.training.tokenizers")


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports(path: Path, top_level_only: bool) -> Set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: Set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def graph(top_level_only: bool) -> Dict[str, Set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py") if "templates" not in p.parts}
    out = {}
    for name, path in modules.items():
        out[name] = {m for m in imports(path, top_level_only) if m in modules and m != name}
    return out


def side(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_each_side_imports_only_what_its_rules_allow():
    wrong = []
    for module, deps in graph(top_level_only=False).items():
        mine = side(module)
        if mine not in ALLOWED:
            continue
        for dep in deps:
            theirs = side(dep)
            if theirs and theirs != mine and theirs not in ALLOWED[mine]:
                wrong.append(f"{module} -> {dep}")
            if mine == "launch" and theirs == "training" and dep not in ("bridge_hpc.training.config",):
                wrong.append(f"{module} -> {dep} (the login side reads only the torch-free training config)")
            if mine in ("cli", "data") and theirs == "training" and dep not in TORCH_FREE_TRAINING:
                wrong.append(f"{module} -> {dep} (data preparation reads only the torch-free training config "
                             "and tokenizer builder)")
    assert not wrong, wrong


def test_no_import_cycle_at_module_level():
    deps = graph(top_level_only=True)
    state: Dict[str, int] = {}

    def visit(node: str, stack: list) -> None:
        state[node] = 1
        for nxt in deps.get(node, ()):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(deps):
        if node not in state:
            visit(node, [node])


def test_login_side_modules_import_no_torch_at_module_level():
    heavy = ("torch", "megatron", "nvidia_resiliency_ext", "numpy")
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        if not any(name == f"bridge_hpc.{p}" or name.startswith(f"bridge_hpc.{p}.") for p in TORCH_FREE):
            continue
        for imported in imports(path, top_level_only=True):
            if imported.split(".")[0] in heavy:
                wrong.append(f"{name} imports {imported}")
    assert not wrong, wrong
