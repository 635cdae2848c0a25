"""The package's floors and their dependency direction, read from the source (no imports run).

Floors, lowest first (:data:`FLOORS`): contracts (stdlib only; every side reads its file formats and
names) -> slurm, peft -> training (the ranks; with the Hugging Face readers and the fast path's
settling) -> jobfile, models (the job file's loader; bridge-hf's tools) -> the rank entry point and
the login node's pieces (rank, launch, prepare, report, local_slurm) -> cli. Every import, counting
imports inside functions, goes to the importer's own folder or to a folder on a lower floor: never
up, never sideways to another folder of its floor. Within that, each folder imports only the folders
:data:`ALLOWED` lists; the login side never imports torch at module level, nor of the training
package more than the torch-free modules (:data:`TORCH_FREE_TRAINING`). No import cycle, and no
package module over :data:`MAX_MODULE_LINES` lines.
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
    "bridge_hpc.training.datasets.indexed_files", "bridge_hpc.training.datasets.jsonl_records",
    # what the seed config keeps apart: the wording of a config's changes, the rank and world size
    "bridge_hpc.training.utils.config_values", "bridge_hpc.training.process.world",
    "bridge_hpc.training.engine", "bridge_hpc.training.engine.config", "bridge_hpc.training.engine.low_precision",
    "bridge_hpc.training.resilience",
    "bridge_hpc.training.resilience.config", "bridge_hpc.training.tokenizers",
    "bridge_hpc.training.tokenizers.config",
    # the fast path's rules: resolved by the job file's loader, settled on each rank
    "bridge_hpc.training.engine.speed_defaults",
    # the login node's checks of a Hugging Face folder (config.json, headers, shapes)
    "bridge_hpc.training.hf", "bridge_hpc.training.hf.families", "bridge_hpc.training.hf.safetensors_files",
    "bridge_hpc.training.hf.mapping", "bridge_hpc.training.hf.mapping_registry", "bridge_hpc.training.hf.param_mapping",
    # the model a toolkit checkpoint was written by (its run_config.json), checked against [model]
    "bridge_hpc.training.checkpoint", "bridge_hpc.training.checkpoint.architecture",
    # torch's compiler and W&B imported when first used: bridge-hf imports megatron-core so, as the ranks do
    "bridge_hpc.training.process", "bridge_hpc.training.process.compiler_imports",
    "bridge_hpc.training.process.lazy_imports",
)
#: The PEFT configs (``[peft]``), read by the torch-free training config: torch-free at module level too.
TORCH_FREE_PEFT = (
    "bridge_hpc.peft", "bridge_hpc.peft.base", "bridge_hpc.peft.lora", "bridge_hpc.peft.dora",
    "bridge_hpc.peft.module_matcher", "bridge_hpc.peft.utils", "bridge_hpc.peft.config", "bridge_hpc.peft.checkpoint",
)
#: The package's folders (and top-level modules) by floor, lowest first. An import goes to the
#: importer's own folder or to a folder on a lower floor, counting imports inside functions: the
#: folders of one floor import none of each other.
FLOORS = (
    ("contracts",),  # what crosses a process boundary: file formats, names, the stop signal
    ("slurm", "peft"),  # the one reader of Slurm; the PEFT configs and adapters
    ("training",),  # the ranks: Bridge's seed modules and their rooms (the Hugging Face readers in hf/)
    ("jobfile", "models"),  # the job file's loader (login node and ranks); bridge-hf's tools
    ("rank", "launch", "prepare", "report", "local_slurm"),  # the ranks' entry point; the login node's pieces
    ("cli",),  # the login node's commands
)
#: side -> the sides it may import (besides itself), each on a lower floor; "training" means only
#: TORCH_FREE_TRAINING for the sides in LOGIN_SIDE.
ALLOWED = {
    "contracts": set(),
    "slurm": {"contracts"},
    "peft": {"contracts"},
    "training": {"contracts", "slurm", "peft"},
    "jobfile": {"contracts", "training"},
    "models": {"contracts", "slurm", "training", "peft"},  # slurm: a world of one's rendezvous port
    "rank": {"contracts", "slurm", "jobfile", "training"},
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
    return imports_of_source(path.read_text(), top_level_only)


def imports_of_source(source: str, top_level_only: bool) -> Set[str]:
    """The modules ``source`` imports (absolute imports; at its top level only, or anywhere: inside
    functions, classes and ``if`` blocks too)."""
    tree = ast.parse(source)
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


def floor(name: str) -> int:
    """The floor of the side ``name`` (0 the lowest); KeyError for a side no floor holds."""
    return {s: i for i, sides in enumerate(FLOORS) for s in sides}[name]


def back_arrows(deps: Dict[str, Set[str]]) -> list:
    """Every import of ``deps`` (module -> modules it imports) that goes to another folder on the
    importer's floor or above it, as ``"a -> b (floor i -> floor j)"``."""
    wrong = []
    for module, targets in sorted(deps.items()):
        mine = side(module)
        for dep in sorted(targets):
            theirs = side(dep)
            if mine and theirs and theirs != mine and floor(theirs) >= floor(mine):
                wrong.append(f"{module} -> {dep} (floor {floor(mine)} {mine} -> floor {floor(theirs)} {theirs})")
    return wrong


def test_each_folder_stands_on_one_floor():
    sides = {side(name) for name in graph(top_level_only=True)} - {""}
    placed = [s for sides_of_floor in FLOORS for s in sides_of_floor]
    assert len(placed) == len(set(placed)), placed
    assert set(placed) == sides, ("on no floor:", sides - set(placed), "no such folder:", set(placed) - sides)
    assert set(ALLOWED) == sides, set(ALLOWED) ^ sides


def test_every_import_goes_down_the_floors_counting_imports_inside_functions():
    wrong = back_arrows(graph(top_level_only=False))
    assert not wrong, wrong


def test_the_allowed_imports_go_down_the_floors():
    up = [f"{mine} -> {theirs}" for mine, theirs_all in ALLOWED.items() for theirs in theirs_all
          if floor(theirs) >= floor(mine)]
    assert not up, up


def test_each_side_imports_only_what_its_rules_allow():
    wrong = []
    for module, deps in graph(top_level_only=False).items():
        mine = side(module)
        if not mine:
            continue
        for dep in deps:
            theirs = side(dep)
            if theirs and theirs != mine and theirs not in ALLOWED[mine]:
                wrong.append(f"{module} -> {dep}")
            if mine in LOGIN_SIDE and theirs == "training" and dep not in TORCH_FREE_TRAINING:
                wrong.append(f"{module} -> {dep} (the login side reads only the torch-free training modules: "
                             "configs, tokenizer builder, fast-path rules, Hugging Face checks)")
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


def test_the_floors_fail_on_a_back_arrow_even_inside_a_function():
    """A back-arrow added to the real graph is found: the two issue 34 removed (training -> jobfile,
    training -> models), one read from an import inside a function, and one sideways on a floor."""
    deps = graph(top_level_only=False)
    assert not back_arrows(deps)
    # what training/run.py had: the job file's loader, imported by the ranks' side (here inside a function)
    source = "def build_config(path):\n    from bridge_hpc.jobfile.jobconfig import load_job_config\n"
    assert "bridge_hpc.jobfile.jobconfig" not in imports_of_source(source, top_level_only=True)
    inside = {m for m in imports_of_source(source, top_level_only=False) if m in deps}
    assert inside == {"bridge_hpc.jobfile.jobconfig"}
    wrong = back_arrows({**deps, "bridge_hpc.training.pretrain": deps["bridge_hpc.training.pretrain"] | inside})
    assert wrong == ["bridge_hpc.training.pretrain -> bridge_hpc.jobfile.jobconfig (floor 2 training -> floor 3 jobfile)"]
    for module, dep in (("bridge_hpc.training.checkpoint.pretrained", "bridge_hpc.models.hf.convert"),  # -> models
                        ("bridge_hpc.contracts.errors", "bridge_hpc.slurm.job_environment"),  # contracts -> slurm
                        ("bridge_hpc.launch.render", "bridge_hpc.report.table"),  # sideways on one floor
                        ("bridge_hpc.jobfile.jobconfig", "bridge_hpc.rank")):  # jobfile -> the ranks' entry point
        wrong = back_arrows({**deps, module: deps[module] | {dep}})
        assert len(wrong) == 1 and wrong[0].startswith(f"{module} -> {dep} "), wrong


def test_no_module_is_a_hub():
    long = {module_name(p): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, long


def test_training_top_level_holds_the_seed_modules_and_the_subpackages():
    """Megatron Bridge's module paths at the top of training/, every other kind of thing in a room."""
    seeds = {"__init__", "config", "pretrain", "finetune", "train", "state", "gpt_step", "losses", "mixed_precision",
             "comm_overlap", "profiling", "forward_step_func_types"}
    rooms = {"tokenizers", "utils", "datasets", "checkpoint", "resilience", "engine", "process", "hf"}
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
        if side(name) not in LOGIN_SIDE and name not in TORCH_FREE_TRAINING + TORCH_FREE_PEFT:
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
