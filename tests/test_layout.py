"""The package's floors and their dependency direction, read from the source (no imports run).

Floors, lowest first: contracts (stdlib only; every side reads its file formats and names) ->
slurm, jobfile -> the login side (launch, report, local_slurm, prepare, cli) and the rank side
(training). A module imports only from its own floor or the floors its rules list: contracts and
jobfile import no side (jobfile reads only the torch-free training configs it validates against);
the login side never imports torch or the training package, except the torch-free configs and the
tokenizer builder; training never imports launch, report or cli. No import cycle, counting imports
inside functions too, and no package module over :data:`MAX_MODULE_LINES` lines.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, Set

PACKAGE = Path(__file__).resolve().parent.parent / "bridge_hpc"

#: The training modules the login side (and jobfile) may import: torch-free at module level. The
#: seed config re-exports the sections that live beside their components; each is listed.
TORCH_FREE_TRAINING = (
    "bridge_hpc.training", "bridge_hpc.training.config", "bridge_hpc.training.mixed_precision",
    "bridge_hpc.training.comm_overlap", "bridge_hpc.training.datasets", "bridge_hpc.training.datasets.config",
    "bridge_hpc.training.engine", "bridge_hpc.training.engine.config", "bridge_hpc.training.resilience",
    "bridge_hpc.training.resilience.config", "bridge_hpc.training.tokenizers",
    "bridge_hpc.training.tokenizers.config",
)
#: The models modules jobfile may import (the login node's checks of a Hugging Face folder): torch-free.
TORCH_FREE_MODELS = ("bridge_hpc.models", "bridge_hpc.models.hf", "bridge_hpc.models.hf.families",
                     "bridge_hpc.models.hf.safetensors_files", "bridge_hpc.models.hf.mapping")
#: The PEFT configs (``[peft]``), read by the torch-free training config: torch-free at module level too.
TORCH_FREE_PEFT = (
    "bridge_hpc.peft", "bridge_hpc.peft.base", "bridge_hpc.peft.lora", "bridge_hpc.peft.dora",
    "bridge_hpc.peft.module_matcher", "bridge_hpc.peft.utils", "bridge_hpc.peft.config", "bridge_hpc.peft.checkpoint",
)
#: side -> the sides it may import (besides itself); "training" means only TORCH_FREE_TRAINING for
#: the sides in LOGIN_SIDE and jobfile; "models" only TORCH_FREE_MODELS for jobfile.
ALLOWED = {
    "contracts": set(),
    "slurm": {"contracts"},
    "jobfile": {"contracts", "training", "models"},
    "training": {"contracts", "slurm", "jobfile", "models", "peft"},
    "models": {"contracts", "training", "peft"},
    "peft": {"contracts"},
    "launch": {"contracts", "slurm", "jobfile", "training"},
    "report": {"contracts"},
    "local_slurm": {"contracts"},
    "prepare": {"contracts", "training"},
    "cli": {"contracts", "slurm", "jobfile", "launch", "report", "local_slurm", "prepare", "training", "models"},
}
#: Sides that run on the login node (or in a batch script before the ranks): no torch at module level,
#: and of the training package only TORCH_FREE_TRAINING.
LOGIN_SIDE = ("contracts", "slurm", "jobfile", "launch", "report", "local_slurm", "prepare", "cli")
#: No module of the package is longer: a longer one holds several kinds of thing.
MAX_MODULE_LINES = 1000


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
            if mine in LOGIN_SIDE and theirs == "training" and dep not in TORCH_FREE_TRAINING:
                wrong.append(f"{module} -> {dep} (the login side reads only the torch-free training configs and "
                             "tokenizer builder)")
            if mine == "jobfile" and theirs == "models" and dep not in TORCH_FREE_MODELS:
                wrong.append(f"{module} -> {dep} (jobfile reads only the torch-free Hugging Face checks)")
    assert not wrong, wrong


def find_cycle(deps: Dict[str, Set[str]]) -> list:
    """One import cycle of ``deps`` (module -> modules it imports) as a path, or []."""
    state: Dict[str, int] = {}

    def visit(node: str, stack: list) -> list:
        state[node] = 1
        for nxt in sorted(deps.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, stack + [nxt])
                if found:
                    return found
        state[node] = 2
        return []

    for node in sorted(deps):
        if node not in state:
            found = visit(node, [node])
            if found:
                return found
    return []


def test_no_import_cycle_counting_imports_inside_functions():
    cycle = find_cycle(graph(top_level_only=False))
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_the_rules_fail_on_a_breach():
    """The checks above can fail: a cycle and a forbidden edge, added to the real graph, are found."""
    deps = graph(top_level_only=False)
    assert find_cycle({**deps, "bridge_hpc.contracts.errors": {"bridge_hpc.training.config"}})
    mine, theirs = "bridge_hpc.launch.render", "bridge_hpc.training.pretrain"
    assert side(theirs) in ALLOWED[side(mine)] and theirs not in TORCH_FREE_TRAINING  # refused by the login rule
    assert "training" not in ALLOWED["contracts"] and "launch" not in ALLOWED["training"]


def test_no_module_is_a_hub():
    long = {module_name(p): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, long


def test_training_top_level_holds_the_seed_modules_and_the_subpackages():
    """Megatron Bridge's module paths at the top of training/, every other kind of thing in a room."""
    seeds = {"__init__", "config", "pretrain", "finetune", "train", "state", "gpt_step", "losses", "mixed_precision",
             "comm_overlap", "profiling", "forward_step_func_types", "run"}
    rooms = {"tokenizers", "utils", "datasets", "checkpoint", "resilience", "engine", "process"}
    top = PACKAGE / "training"
    modules = {p.stem for p in top.glob("*.py")}
    folders = {p.name for p in top.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert modules == seeds and folders == rooms, (modules ^ seeds, folders ^ rooms)


def test_login_side_modules_import_no_torch_at_module_level():
    """The login side and the training modules it reads import torch (megatron, ...) only inside the
    functions the ranks call."""
    heavy = ("torch", "megatron", "nvidia_resiliency_ext", "numpy")
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        if side(name) not in LOGIN_SIDE and name not in TORCH_FREE_TRAINING + TORCH_FREE_MODELS + TORCH_FREE_PEFT:
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
