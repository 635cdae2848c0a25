"""The package's sides and their dependency direction, read from the source (no imports run).

cli -> launch / report / local_slurm -> slurm -> contracts, and training -> slurm -> contracts;
cli -> data -> the torch-free training config and tokenizer builder (bridge-prepare-data);
contracts imports nothing of ours; the login side imports no torch at module level; no cycles.
"""

from __future__ import annotations

import ast
import re
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
              "training.signal_recorder", "training.tokenizers", "training.mixed_precision", "training.comm_overlap")


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


def _string_literals(path: Path) -> Set[str]:
    """Every string constant in a Python module (docstrings and comments aside: only what code uses)."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return {node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings}


def test_each_run_folder_name_and_the_stop_signal_list_are_defined_once():
    """The contracts between the login node, the batch script and the ranks are spelled in one place:
    no other module (or template) writes a run-folder file name or the allowed stop signals itself."""
    from bridge_hpc.contracts import run_folder, signals

    # (names of five characters or fewer, "logs" or ".lock", are too common a word to search for)
    names = {value for key, value in vars(run_folder).items()
             if key.isupper() and isinstance(value, str) and len(value) > 5}
    assert {"job.sbatch", "resolved.toml", "jobs.jsonl", "metrics.jsonl", "progress.txt",
            "latest_checkpointed_iteration.txt", "ft_state.json", "requeue-request."} <= names
    definitions = {PACKAGE / "contracts" / "run_folder.py", PACKAGE / "contracts" / "signals.py"}
    spelled = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path in definitions:
            continue
        literals = _string_literals(path)
        spelled += [f"{path.relative_to(PACKAGE.parent)}: {name!r}" for name in sorted(names & literals)]
        spelled += [f"{path.relative_to(PACKAGE.parent)}: {name!r}" for name in signals.ALLOWED if name in literals]
    templates = PACKAGE.parent / "templates"
    for path in sorted(templates.rglob("*.j2")):
        # what the script itself says: jinja expressions and shell comments aside
        text = re.sub(r"\{\{.*?\}\}|\{%.*?%\}|\{#.*?#\}", "", path.read_text(), flags=re.S)
        text = re.sub(r"^\s*#.*$", "", text, flags=re.M)
        spelled += [f"{path.relative_to(PACKAGE.parent)}: {name!r}" for name in sorted(names) if name in text]
        spelled += [f"{path.relative_to(PACKAGE.parent)}: {name}" for name in signals.ALLOWED
                    if re.search(rf"\b(SIG)?{name}\b", text)]
    assert not spelled, spelled
