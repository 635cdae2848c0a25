"""The standard library's docstrings as a jsonl corpus: real English text that every machine with Python has.

``python -m bridge_hpc.prepare.stdlib_corpus OUT_DIR`` writes ``OUT_DIR/train.jsonl`` and
``OUT_DIR/valid.jsonl``, one ``{"text": ...}`` document per docstring, for ``bridge-prepare-data``. It
exists so that the real-data demo (``configs/local-tiny-text.toml``, ``make demo-text``) trains on text
without downloading anything. With ``--sft`` it writes fine-tuning data instead, in Megatron Bridge's
``dataset_root`` layout (``training.jsonl``, ``validation.jsonl``): one ``{"input": "Docstring of
json.dumps:\n", "output": <the docstring>}`` pair per docstring, for the fine-tuning demo
(``configs/local-tiny-sft.toml``, ``make demo-sft``), which teaches the pretrained model to answer
with the documentation of the object it is asked about.

What is collected: the docstrings of the public standard-library modules (``sys.stdlib_module_names``
and their submodules, found by ``pkgutil`` and imported; a module that does not import here is
skipped), of the public classes and functions each module defines itself (not the names it
re-exports), and of the public methods and properties of those classes. Only the docstring an object
carries is taken (never an inherited or generated signature, whose default values can show memory
addresses), cleaned by :func:`inspect.cleandoc`, and each distinct text is kept once, at its first
occurrence.

Held-out text is disjoint from the training text by construction: a top-level module and all its
submodules go to one file, chosen by a hash of the top-level name (:func:`split_of`), and a docstring
that occurs in several modules is kept only once. Modules are visited in sorted order and the members
of each in sorted order, so two runs on the same Python write the same bytes.

A few modules are never imported (:data:`NOT_IMPORTED`): those whose import does something (opens a
web browser, runs a program) and CPython's own test suite. Anything a module prints while it is
imported is swallowed, and so are its warnings (deprecations).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import inspect
import io
import json
import os
import pkgutil
import sys
import sysconfig
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Dict, Iterator, List, Optional, Sequence, TextIO, Tuple

from bridge_hpc.contracts.errors import ConfigError, exits_on_config_error
from bridge_hpc.training.config import FINETUNING_FILES

#: The two files written into OUT_DIR, by split.
SPLIT_FILES = {"train": "train.jsonl", "valid": "valid.jsonl"}
#: With ``--sft``: the fine-tuning files of a ``dataset_root`` (Megatron Bridge's names).
SFT_FILES = {split: FINETUNING_FILES[split] for split in SPLIT_FILES}
#: The json key of each document (``bridge-prepare-data``'s default ``--json-keys``).
TEXT_KEY = "text"
#: With ``--sft``: the prompt asks for an object's documentation; ``FinetuningDatasetConfig``'s
#: default fields hold the prompt and the answer.
SFT_PROMPT = "Docstring of {name}:\n"
SFT_PROMPT_KEY, SFT_ANSWER_KEY = "input", "output"
#: Share of top-level modules (by hash of the name, not by size) whose text is held out for validation.
VALID_PERCENT = 10
#: Top-level modules (and packages) never imported, and why.
NOT_IMPORTED = {
    "antigravity": "opens a web browser when imported",
    "this": "prints the Zen of Python when imported",
    "idlelib": "the IDLE application: its modules start GUI pieces and read user configuration",
    "turtledemo": "GUI demo programs",
    "test": "CPython's regression tests: thousands of modules, some with side effects when imported",
}
#: Subpackages and submodules (at any depth) that hold the library's own tests, not its documentation.
TEST_MODULE_NAMES = ("test", "tests", "idle_test")
#: Seconds between two progress lines on stderr.
PROGRESS_INTERVAL_S = 5.0


def split_of(top_level: str) -> str:
    """``"valid"`` for about :data:`VALID_PERCENT` % of top-level module names, else ``"train"``.

    sha256, not ``hash()``: the choice must not depend on PYTHONHASHSEED, so that every run (and the
    test) puts a module on the same side.
    """
    bucket = int.from_bytes(hashlib.sha256(top_level.encode()).digest()[:4], "big") % 100
    return "valid" if bucket < VALID_PERCENT else "train"


def top_level_modules() -> List[str]:
    """The public top-level standard-library modules, sorted, less :data:`NOT_IMPORTED`."""
    return sorted(name for name in sys.stdlib_module_names if not name.startswith("_") and name not in NOT_IMPORTED)


def _stdlib_folders() -> List[str]:
    paths = sysconfig.get_paths()
    return sorted({os.path.realpath(paths[key]) for key in ("stdlib", "platstdlib")})


def _installed_folders() -> List[str]:
    paths = sysconfig.get_paths()
    return sorted({os.path.realpath(paths[key]) for key in ("purelib", "platlib")})


def is_stdlib_module(module: ModuleType) -> bool:
    """Built into the interpreter or loaded from the standard library's folder (not site-packages).

    ``sys.stdlib_module_names`` names ``distutils``, which setuptools replaces with its own copy: its
    docstrings would change with the installed setuptools, so it would not be the standard library's.
    """
    file = getattr(module, "__file__", None)
    if file is None:  # built into the interpreter
        return True
    path = os.path.realpath(file)
    inside = any(path.startswith(folder + os.sep) for folder in _stdlib_folders())
    return inside and not any(path.startswith(folder + os.sep) for folder in _installed_folders())


def _quiet_import(name: str) -> Optional[ModuleType]:
    """The module, or None when it does not import here (missing C extension, other platform, ...)."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(name)
        except (Exception, SystemExit):
            return None


def is_walked_submodule(name: str) -> bool:
    """Public and not test code. (``__main__`` is private by this rule, and must be: importing it runs
    its program.)"""
    return not name.startswith("_") and name not in TEST_MODULE_NAMES and not name.startswith("test_")


def walk_modules(name: str, skipped: Dict[str, str]) -> Iterator[ModuleType]:
    """Module ``name`` and its walked submodules (:func:`is_walked_submodule`), depth first in sorted
    order; a module left out is recorded in ``skipped`` with the reason."""
    module = _quiet_import(name)
    if module is None:
        skipped[name] = "does not import"
        return
    if not is_stdlib_module(module):
        skipped[name] = f"imports from outside the standard library ({module.__file__})"
        return
    yield module
    path = getattr(module, "__path__", None)
    if path is None:
        return
    for info in sorted(pkgutil.iter_modules(path), key=lambda i: i.name):
        if is_walked_submodule(info.name):
            yield from walk_modules(f"{name}.{info.name}", skipped)


def _own_members(module: ModuleType) -> Iterator[Tuple[str, object]]:
    """``(dotted name, object)`` of the public classes and functions ``module`` defines (sorted by
    name), each class followed by its public methods and properties."""
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj):
            yield f"{module.__name__}.{name}", obj
            for attr, member in sorted(vars(obj).items()):
                if attr.startswith("_"):
                    continue
                member = getattr(member, "__func__", member)  # classmethod / staticmethod
                if inspect.isroutine(member) or isinstance(member, property):
                    yield f"{module.__name__}.{name}.{attr}", member
        elif inspect.isroutine(obj):
            yield f"{module.__name__}.{name}", obj


def docstrings(module: ModuleType) -> Iterator[Tuple[str, str]]:
    """``(dotted name, docstring)``: the module's own, then its members' (:func:`_own_members`),
    cleaned; empty ones left out."""
    for name, obj in ((module.__name__, module), *_own_members(module)):
        doc = vars(obj).get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
        if isinstance(doc, str):
            text = inspect.cleandoc(doc).strip()
            if text:
                yield name, text


@dataclass
class SplitTotals:
    """What one file received."""

    path: Path
    documents: int = 0
    bytes: int = 0
    modules: List[str] = field(default_factory=list)


def build_corpus(out_dir: Path, only: Sequence[str] = (), progress: Optional[TextIO] = None,
                 sft: bool = False) -> Dict[str, SplitTotals]:
    """Write train.jsonl and valid.jsonl into ``out_dir`` (each atomically); returns the totals by split.
    With ``sft``: training.jsonl and validation.jsonl of prompt/answer pairs (:data:`SFT_PROMPT`).

    ``only`` restricts the walk to these top-level modules (all of :func:`top_level_modules` when empty).
    """
    names = top_level_modules()
    unknown = sorted(set(only) - set(names))
    if unknown:
        raise ConfigError(f"{', '.join(unknown)}: not public top-level standard-library modules of this Python "
                          f"(never imported: {', '.join(sorted(NOT_IMPORTED))})", key="--modules")
    if only:
        names = [n for n in names if n in set(only)]
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot create the folder: {err.strerror or err}", path=str(out_dir)) from None
    totals = {split: SplitTotals(out_dir / file) for split, file in (SFT_FILES if sft else SPLIT_FILES).items()}
    temporary = {split: t.path.with_name(t.path.name + ".tmp") for split, t in totals.items()}
    seen: set = set()
    skipped: Dict[str, str] = {}
    last_report = time.monotonic()
    try:
        files = {split: open(path, "w", encoding="utf-8") for split, path in temporary.items()}
    except OSError as err:
        raise ConfigError(f"cannot write: {err.strerror or err}", path=str(out_dir)) from None
    with contextlib.ExitStack() as stack:
        for f in files.values():
            stack.enter_context(f)
        for i, top in enumerate(names):
            split = split_of(top)
            for module in walk_modules(top, skipped):
                totals[split].modules.append(module.__name__)
                for name, text in docstrings(module):
                    if text in seen:
                        continue
                    seen.add(text)
                    record = ({SFT_PROMPT_KEY: SFT_PROMPT.format(name=name), SFT_ANSWER_KEY: text} if sft
                              else {TEXT_KEY: text})
                    line = json.dumps(record, ensure_ascii=False) + "\n"
                    files[split].write(line)
                    totals[split].documents += 1
                    totals[split].bytes += len(line.encode("utf-8"))
            if progress is not None and time.monotonic() - last_report >= PROGRESS_INTERVAL_S:
                last_report = time.monotonic()
                print(f"[stdlib-corpus] {i + 1}/{len(names)} top-level modules, "
                      f"{sum(t.documents for t in totals.values())} documents", file=progress, flush=True)
    for split, t in totals.items():
        os.replace(temporary[split], t.path)
    if progress is not None and skipped:
        reasons = sorted(set(skipped.values()))
        for reason in reasons:
            names = [n for n, r in skipped.items() if r == reason]
            print(f"[stdlib-corpus] skipped, {reason}: {', '.join(names)}", file=progress)
    return totals


def summary_table(totals: Dict[str, SplitTotals]) -> str:
    """A table: file, documents, bytes, modules (and which top-level modules validation holds out)."""
    rows = [("file", "documents", "bytes", "modules")]
    rows += [(str(t.path), str(t.documents), str(t.bytes), str(len(t.modules))) for t in totals.values()]
    widths = [max(len(r[c]) for r in rows) for c in range(4)]
    lines = ["  ".join(cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in enumerate(zip(r, widths)))
             for r in rows]
    held_out = sorted({m.partition(".")[0] for m in totals["valid"].modules})
    lines.append(f"held out for validation: {', '.join(held_out) or '(none)'}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bridge_hpc.prepare.stdlib_corpus", description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="folder for train.jsonl and valid.jsonl")
    p.add_argument("--sft", action="store_true",
                   help="write fine-tuning pairs instead: training.jsonl and validation.jsonl of "
                        '{"input": "Docstring of NAME:\\n", "output": DOCSTRING} (a dataset_root)')
    p.add_argument("--modules", nargs="+", default=[], metavar="NAME",
                   help="only these top-level modules (default: the whole standard library)")
    return p


@exits_on_config_error
def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    totals = build_corpus(args.out_dir, args.modules, progress=sys.stderr, sft=args.sft)
    print(summary_table(totals))
    return 0


if __name__ == "__main__":
    sys.exit(main())
