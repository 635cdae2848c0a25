"""Hostile job configs by the hundred, through ``bridge-submit --dry-run`` (issue 9's done-when item).

A seeded generator (reproducible: ``SEED``) derives ``VARIANTS`` variants from the example configs
(configs/*.toml with their cluster profiles, tests/data/tiny.toml). Each variant changes one thing:
a value (wrong types, edge numbers, unicode, control characters, ``$(…)``, backticks, quotes,
newlines), a key or a section name, a file name, ``extends`` (loops, explosions, wrong types, files
that are not configs), the nesting depth, a ``--set`` override, or points ``job.run_dir`` somewhere
unwritable. Every variant must either

- exit 0 with a script that passes ``bash -n``, whose resolved config loads back to itself, and that
  runs nothing injected when executed with ``srun``, ``scontrol``, ... shimmed (every accepted variant
  that carries a payload is executed, up to ``EXECUTE_AT_MOST``), or
- exit 2 with one line on stderr, no traceback, naming the key the variant changed (as the loader
  spells it; a related key where the loader checks two keys against each other) or, for a file name,
  that file.

A secret's value (``HF_TOKEN``, itself hostile) must never appear in a script. Variants whose
run folder is unwritable are also submitted for real (in-process, ``sbatch`` shimmed): exit 2 naming
``job.run_dir`` and nothing submitted. bridge-submit runs in-process (its ``main``), not as a
subprocess per variant, to keep the test around a minute.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import io
import math
import os
import random
import re
import subprocess
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple

import pytest
import toml

from bridge_hpc.cli.submit import main as submit_main
from bridge_hpc.contracts.text import one_line
from bridge_hpc.jobfile.jobconfig import dump_resolved, load_job_config

ROOT = Path(__file__).resolve().parent.parent
SEED = 9  # issue 9
VARIANTS = 1000  # random ones, on top of the corpus (Generator.corpus)
EXECUTE_AT_MOST = 300
SECRET_VAR = "HF_TOKEN"

#: (name, job file): the examples, each with the cluster profile it extends
BASES = [
    ("local-tiny", "configs/local-tiny.toml"),
    ("local-tiny-fault-tolerance", "configs/local-tiny-fault-tolerance.toml"),
    ("gpt-126m-h100", "configs/gpt-126m-h100.toml"),
    ("gpt-8x4096-h100-fp8", "configs/gpt-8x4096-h100-fp8.toml"),
    ("tiny", "tests/data/tiny.toml"),
    ("local-tiny-moe", "configs/local-tiny-moe.toml"),
]

#: Where the loader checks one key against another, an error may name the other one.
RELATED = {
    "slurm.time": {"slurm.signal"},
    "slurm.signal": {"train.exit_signal"},
    "slurm.cpus_per_task": {"slurm.ntasks_per_node"},
    "slurm.partition": set(),
    "cluster.partitions": {"slurm.partition"},
    "cluster.gpus_per_node": {"slurm.gpus_per_node"},
    "cluster.cpus_per_node": {"slurm.ntasks_per_node"},
    "cluster.max_time": {"slurm.time"},
    "slurm.gpus_per_node": set(),
    "cluster.gpu_model": {"mixed_precision.fp8", "mixed_precision.fp8_recipe", "mixed_precision.fp4_recipe"},
    "train.micro_batch_size": {"train.global_batch_size"},
    "train.global_batch_size": {"train.micro_batch_size"},
    "train.eval_interval": {"train.eval_iters"},
    "model.hidden_size": {"model.num_attention_heads", "model.ffn_hidden_size", "model.kv_channels"},
    "model.num_attention_heads": {"model.hidden_size", "model.num_query_groups"},
    "model.seq_length": {"dataset.seq_length"},
    "dataset.seq_length": {"model.seq_length"},
    "optimizer.lr": {"optimizer.min_lr"},
    "optimizer.min_lr": {"optimizer.lr"},
    "scheduler.lr_warmup_iters": {"train.train_iters", "scheduler.lr_decay_iters"},
    "train.train_iters": {"scheduler.lr_warmup_iters", "scheduler.lr_decay_iters"},
    "checkpoint.save_interval": {"checkpoint.save"},
    "ft.enable_ft_package": set(),
    # Mixture-of-Experts: the fields are checked against each other, the layers and the world
    "model.num_moe_experts": {"model.moe_router_topk", "model.expert_model_parallel_size",
                              "model.moe_router_num_groups"},
    "model.moe_router_topk": {"model.num_moe_experts"},
    "model.add_bias_linear": {"model.moe_shared_expert_intermediate_size"},
    "model.num_layers": {"model.moe_layer_freq"},
    "model.ffn_hidden_size": {"model.expert_tensor_parallel_size"},
    "model.moe_ffn_hidden_size": {"model.expert_tensor_parallel_size"},
    "model.moe_shared_expert_intermediate_size": {"model.moe_shared_expert_gate"},
    "model.tensor_model_parallel_size": {"model.expert_tensor_parallel_size", "model.expert_model_parallel_size"},
    "model.transformer_impl": {"model.moe_grouped_gemm", "model.moe_permute_fusion", "model.moe_router_fusion"},
    "slurm.ntasks_per_node": {"model.expert_model_parallel_size"},
    "slurm.nodes": {"model.expert_model_parallel_size"},
}


class Raw(str):
    """A value written into the TOML text as it is (deep nesting built as text, not recursively)."""


# --------------------------------------------------------------------------- writing TOML


def toml_key(key: str) -> str:
    if key and all(c.isascii() and (c.isalnum() or c in "_-") for c in key):
        return key
    return toml_string(key)


def toml_string(text: str) -> str:
    out = ['"']
    for c in text:
        if c == '"':
            out.append('\\"')
        elif c == "\\":
            out.append("\\\\")
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(c)
    out.append('"')
    return "".join(out)


def toml_value(value: Any) -> str:
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, datetime.datetime):
        return value.strftime("%Y-%m-%dT%H:%M:%SZ")
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(value)


def toml_text(doc: Dict[str, Any]) -> str:
    lines = [f"{toml_key(k)} = {toml_value(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    for section, body in doc.items():
        if isinstance(body, dict):
            lines.append(f"\n[{toml_key(section)}]")
            lines.extend(f"{toml_key(k)} = {toml_value(v)}" for k, v in body.items())
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- hostile values


def hostile_strings(marker: Path) -> List[str]:
    t = f"touch {marker}"
    return [
        f"$({t})", f"`{t}`", f'"; {t}; "', f"'; {t}; '", f"x\n{t}", f"x\r\n{t}\r", f"x;{t}", f"x|{t}", f"x&&{t}",
        f"x\n#SBATCH --wrap='{t}'", f"x\" --wrap=\"{t}", f"x' --wrap='{t}", f"x\\\" --wrap=\\\"{t}",
        f"#SBATCH --wrap='{t}'", f"a[$({t})]", f"${{x:-$({t})}}", f"$'\\n'{t}", f"\u202e$({t})", f"x\u2028{t}",
        f"x\u0085{t}", f"x\x1b]0;$({t})\x07", f"x\x00{t}", f"$(touch${{IFS}}{marker})", f"x\t$({t})",
        f"{{{{ {t} }}}}", f"{{% {t} %}}", f"$(({t}))", f"<({t})", f"!{t}", f"\\$({t})", f"x\x0b$({t})",
        "'", '"', "\\", "", " ", "\t", "\u200b", "\ufeff", "😀", "e\u0301", "ſ", "a" * 5000, "-", "--help",
        "%j%x%%", "#", "*", "?", "~", "~root", "$HOME", "${PATH}", "../..", "/", ".", "\x7f", "\u0090",
    ]


OTHER_VALUES: List[Any] = [
    0, -1, 1, 7, 2**31 - 1, 2**31, 2**63 - 1, -(2**63), 2**64, -(2**64), 10**100, 0.5, -0.0, 1e308, 5e-324,
    math.nan, math.inf, -math.inf, True, False, [], {}, [1, "a"], [[1]], {"a": 1}, datetime.time(7, 32),
    datetime.date(2026, 1, 1), datetime.datetime(2026, 1, 1, 0, 0, 0),
]

#: Fields that take free text (or a list of it), so that payloads get accepted and then executed.
TEXT_FIELDS = [
    ("job", "name"), ("job", "python"), ("job", "description"), ("job", "run_dir"), ("job", "forward_step"),
    ("slurm", "account"), ("slurm", "qos"), ("slurm", "mem"), ("slurm", "constraint"), ("slurm", "dependency"),
    ("slurm", "array"), ("slurm", "mail_user"), ("slurm", "mail_type"), ("slurm", "time"), ("slurm", "signal"),
    ("slurm", "partition"), ("slurm", "extra", "reservation"), ("slurm", "extra", "comment"),
    ("env", "NEW_VAR"), ("env", "OMP_NUM_THREADS"), ("env", "PATH"), ("env", "LD_PRELOAD"),
    ("env", "BASH_ENV"), ("env", "ENV"), ("env", "SHELLOPTS"), ("env", "PS4"), ("env", "IFS"),
    ("env", "PROMPT_COMMAND"), ("env", "SLURM_RESTART_COUNT"), ("env", "SLURM_JOB_ID"), ("env", "SLURM_ARRAY_JOB_ID"),
    ("env", "BRIDGE_CONFIG"), ("env", "BRIDGE_REQUEUE_FILE"),
    ("setup", "modules", []), ("setup", "source", []), ("setup", "venv"), ("setup", "conda_env"),
    ("container", "image"), ("container", "mounts", []), ("container", "workdir"), ("container", "env_file"),
    ("cluster", "name"), ("logger", "tensorboard_dir"), ("checkpoint", "save"), ("checkpoint", "load"),
    ("train", "exit_signal"), ("train", "exit_signal", []),
]

UNWRITABLE_RUN_DIRS = ["/etc/passwd/x", "/proc/bridge-fuzz/run", "/proc/self/status/run", "/sys/bridge-fuzz",
                       "/dev/null/run", "{vdir}/a-file/run"]


# --------------------------------------------------------------------------- variants


@dataclass
class Variant:
    index: int
    base: str
    kind: str
    docs: Dict[str, Dict[str, Any]]  # relative path -> TOML document
    job: str = "job.toml"
    raw: Dict[str, bytes] = field(default_factory=dict)  # relative path -> bytes, written as they are
    symlinks: Dict[str, str] = field(default_factory=dict)
    overrides: List[str] = field(default_factory=list)
    keys: Set[str] = field(default_factory=set)  # an exit 2 must name one of these (empty: any key)
    file: Optional[str] = None  # ... and this file name (default: the job file)
    unwritable: bool = False
    note: str = ""

    def describe(self) -> str:
        return f"variant {self.index} ({self.base}, {self.kind}): {self.note}"

    @property
    def expected_file(self) -> str:
        return self.file if self.file is not None else self.job


def dotted_forms(parts: Tuple[str, ...]) -> Set[str]:
    """How the loader may name a key path: itself or a table above it (a whole table of the wrong
    type), with a part that holds control characters written as its repr."""
    out = set()
    for n in range(1, len(parts) + 1):
        head = parts[:n]
        out.add(".".join(head))
        out.add(".".join(head[:-1] + (repr(head[-1]),)))
    return {k for k in out if "." in k} or out


def expected_keys(parts: Tuple[str, ...]) -> Set[str]:
    keys = dotted_forms(parts)
    for key in list(keys):
        keys |= RELATED.get(key, set())
    return keys


class Generator:
    def __init__(self, seed: int, marker: Path):
        self.rng = random.Random(seed)
        self.marker = marker
        self.strings = hostile_strings(marker)
        self.bases = []
        for name, rel in BASES:
            path = ROOT / rel
            docs = {"job.toml": toml.loads(path.read_text())}
            profiles = docs["job.toml"].get("extends", [])
            for profile in [profiles] if isinstance(profiles, str) else profiles:
                docs[profile] = toml.loads((path.parent / profile).read_text())
            self.bases.append((name, docs))

    # -- helpers
    def hostile_string(self) -> str:
        return self.rng.choice(self.strings)

    def hostile_value(self, original: Any = None) -> Any:
        r = self.rng.random()
        if r < 0.45:
            return self.hostile_string()
        if r < 0.6 and isinstance(original, str):
            return original + self.hostile_string()
        if r < 0.7 and isinstance(original, list):
            return list(original) + [self.hostile_string()]
        if r < 0.75:
            return [self.hostile_string()]
        if r < 0.8:
            return {self.hostile_string(): self.hostile_string()}
        return copy.deepcopy(self.rng.choice(OTHER_VALUES))

    def leaves(self, doc: Dict[str, Any]) -> List[Tuple[str, ...]]:
        out = []
        for section, body in doc.items():
            if not isinstance(body, dict):
                out.append((section,))
                continue
            for key, value in body.items():
                out.append((section, key))
                if isinstance(value, dict):
                    out.extend((section, key, sub) for sub in value)
        return out

    def new(self, index: int, kind: str) -> Variant:
        name, docs = self.rng.choice(self.bases)
        v = Variant(index=index, base=name, kind=kind, docs=copy.deepcopy(docs))
        v.docs["job.toml"].setdefault("job", {})["run_dir"] = "run"
        return v

    # -- the mutations
    def value(self, v: Variant) -> None:
        target = self.rng.choice([p for p in v.docs if p != "job.toml"] + ["job.toml"] * 3)
        doc = v.docs[target]
        parts = self.rng.choice(self.leaves(doc))
        container = doc
        for part in parts[:-1]:
            container = container[part]
        container[parts[-1]] = new = self.hostile_value(container[parts[-1]])
        v.keys = expected_keys(parts)
        if isinstance(new, dict):  # a table in place of a value: its own keys may be the ones named
            for key in new:
                v.keys |= dotted_forms(parts + (key,))
        v.file = target
        v.note = f"{target}: {'.'.join(parts)} = {new!r:.120}"
        if target != "job.toml" and self._job_sets(v, parts):
            v.keys, v.file = set(), None  # the job file's own value wins: nothing may fail

    def _job_sets(self, v: Variant, parts: Tuple[str, ...]) -> bool:
        node: Any = v.docs["job.toml"]
        for part in parts:
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True

    def text_field(self, v: Variant, spec: Optional[tuple] = None, payload: Optional[str] = None) -> None:
        spec = spec or self.rng.choice(TEXT_FIELDS)
        as_list = spec[-1] == []
        parts = tuple(p for p in spec if p != [])
        doc = v.docs["job.toml"]
        if parts[0] == "container" and "container" not in doc:
            doc["container"] = {"image": "nvcr.io#nvidia/pytorch:25.09-py3"}
        node = doc
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        original = node.get(parts[-1])
        if payload is None:
            payload = self.hostile_string()
            if isinstance(original, str) and self.rng.random() < 0.5:
                payload = original + payload
        node[parts[-1]] = [payload] if as_list else payload
        v.keys = expected_keys(parts[:2] if parts[0] == "env" else parts)
        v.note = f"{'.'.join(parts)} = {node[parts[-1]]!r:.120}"

    def secret(self, v: Variant) -> None:
        name = self.rng.choice(["API_TOKEN", "WANDB_API_KEY", "HF_TOKEN", "BASH_ENV", "x-y"])
        source = self.rng.choice([SECRET_VAR, SECRET_VAR, "BRIDGE_FUZZ_UNSET_SECRET", self.hostile_string(), 5])
        v.docs["job.toml"].setdefault("env", {})[name] = {"from_shell": source}
        v.keys = expected_keys(("env", name, "from_shell"))
        v.note = f"env.{name} = {{ from_shell = {source!r:.80} }}"

    def key(self, v: Variant) -> None:
        doc = v.docs["job.toml"]
        sections = [s for s, body in doc.items() if isinstance(body, dict) and body]
        section = self.rng.choice(sections)
        body = doc[section]
        old = self.rng.choice(list(body))
        new = self.rng.choice([old + self.hostile_string(), self.hostile_string(), old.upper() + "\n", "a.b", ""])
        if new in body or new == old:
            new = old + "$(x)"
        doc[section] = {(new if k == old else k): val for k, val in body.items()}
        v.keys = dotted_forms((section, new))
        v.note = f"[{section}] key {old!r} -> {new!r:.120}"

    def extra_key(self, v: Variant) -> None:
        key = self.rng.choice([self.hostile_string(), "wrap", "output", "export", "Reservation", "a_b", "x\ny"])
        v.docs["job.toml"].setdefault("slurm", {}).setdefault("extra", {})[key] = self.rng.choice(["x", 1, True])
        v.keys = dotted_forms(("slurm", "extra", key)) | {"slurm.extra"}
        v.note = f"slurm.extra key {key!r:.120}"

    def section(self, v: Variant) -> None:
        doc = v.docs["job.toml"]
        r = self.rng.random()
        if r < 0.4:
            old = self.rng.choice([s for s in doc if isinstance(doc[s], dict)])
            new = self.rng.choice([old + self.hostile_string(), self.hostile_string(), old.upper()])
            v.docs["job.toml"] = {(new if k == old else k): val for k, val in doc.items()}
            v.keys = dotted_forms((new,))
            v.note = f"section {old!r} -> {new!r:.120}"
        elif r < 0.7:
            old = self.rng.choice([s for s in doc if isinstance(doc[s], dict)])
            doc[old] = self.hostile_value()
            v.keys = {old} | {k for key in (doc[old] if isinstance(doc[old], dict) else ()) for k in dotted_forms((old, key))}
            v.note = f"section {old} = {doc[old]!r:.120}"
        else:
            new = self.hostile_string()
            doc[new] = {"x": 1} if self.rng.random() < 0.5 else 1
            v.keys = dotted_forms((new,))
            v.note = f"new section {new!r:.120}"

    def file_name(self, v: Variant) -> None:
        stem = self.rng.choice([s for s in self.strings if "/" not in s and "\x00" not in s and len(s) < 200] + ["-x"])
        name = self.rng.choice([f"{stem}.toml", f"job{stem}", stem or "empty"])
        if name in (".", "..", "") or name.startswith("-"):
            name = "_" + name
        if self.rng.random() < 0.5 or not any(p.startswith("clusters/") for p in v.docs):
            v.docs[name] = v.docs.pop("job.toml")
            v.job = name
            v.docs[name]["job"].pop("run_dir", None)  # defaults from the name: runs/<job.name>
            if self.rng.random() < 0.5:
                v.docs[name]["job"].pop("name", None)
            v.keys = set()
            v.file = name
            v.note = f"job file named {name!r:.120}"
        else:
            profile = "clusters/" + name
            job = v.docs["job.toml"]
            old = job.get("extends")
            if isinstance(old, str) and old in v.docs:
                v.docs[profile] = v.docs.pop(old)
            else:
                v.docs[profile] = {}
            job["extends"] = profile
            v.keys = {"extends"}
            v.file = "job.toml"
            v.note = f"profile named {profile!r:.120}"

    def extends(self, v: Variant) -> None:
        job = v.docs["job.toml"]
        profiles = [p for p in v.docs if p != "job.toml"]
        choice = self.rng.randrange(9)
        v.keys, v.file = {"extends"}, None
        if choice == 0:
            job["extends"] = "job.toml"
            v.note = "extends itself"
        elif choice == 1 and profiles:
            p = profiles[0]
            job["extends"] = p
            v.docs[p]["extends"] = "../job.toml"
            v.file = p
            v.note = f"job <-> {p}"
        elif choice == 2:
            job["extends"] = "a.toml"
            v.docs["a.toml"] = {"extends": "b.toml"}
            v.docs["b.toml"] = {"extends": ["c.toml"]}
            v.docs["c.toml"] = {"extends": "a.toml"}
            v.file = "c.toml"
            v.note = "a -> b -> c -> a"
        elif choice == 3:
            depth = self.rng.choice([6, 12])
            job["extends"] = ["p0.toml", "p0.toml"]
            for i in range(depth):
                v.docs[f"p{i}.toml"] = {"extends": [f"p{i + 1}.toml", f"p{i + 1}.toml"]}
            v.docs[f"p{depth}.toml"] = {"slurm": {"time": "00:10:00"}}
            v.file = ""  # whichever file the count runs out in
            v.note = f"extends doubling {depth} levels deep"
        elif choice == 4:
            job["extends"] = copy.deepcopy(self.rng.choice([1, True, [1], {"a": 1}, [["x"]], "", " ", [""], 1.5,
                                                            datetime.time(7, 0), [profiles[0] if profiles else "x", 2]]))
            v.note = f"extends = {job['extends']!r}"
        elif choice == 5:
            target = self.rng.choice(["nope.toml", "clusters", "/dev/null", "/dev/zero", "/proc/self/environ",
                                      "/etc/passwd", "/proc/self/cmdline", "/dev/stdin", "~bridge-no-such-user/x.toml",
                                      "x" * 300 + ".toml", "../" * 60 + "etc/hostname", "/", "loop.toml",
                                      "clusters/local.toml\n", "clusters/local.toml\x00"])
            if target == "loop.toml":
                v.symlinks = {"loop.toml": "loop2.toml", "loop2.toml": "loop.toml"}
            job["extends"] = target
            v.note = f"extends = {target!r:.80}"
        elif choice == 6:
            name = self.hostile_string()
            if "/" in name or "\x00" in name or not name.strip(". ") or len(name) > 200:
                name = "p$(touch x)"
            rel = f"{name}.toml"
            job["extends"] = rel
            v.docs[rel] = {"slurm": {"time": "00:20:00"}}
            v.keys, v.file = {"extends"}, None
            v.note = f"extends a profile named {rel!r:.80}"
        elif choice == 7 and profiles:
            p = profiles[0]
            job["extends"] = p
            v.docs[p]["extends"] = self.hostile_value()
            v.file = p
            v.note = f"{p}: extends = {v.docs[p]['extends']!r:.80}"
        else:
            job["extends"] = [profiles[0] if profiles else "p.toml"] * 2
            v.docs.setdefault("p.toml", {})
            v.keys = set()
            v.note = "the same profile twice"

    def nesting(self, v: Variant) -> None:
        doc = v.docs["job.toml"]
        depth = self.rng.choice([15, 17, 40, 200, 3000])
        section = self.rng.choice(["train", "slurm", "env", "model", "setup", "job", "x"])
        key = self.rng.choice(["x", "extra", "modules", "train_iters", "name"])
        if self.rng.random() < 0.5:
            value = Raw("[" * depth + "1" + "]" * depth)
        else:
            value = Raw("{a = " * depth + "1" + "}" * depth)
        doc.setdefault(section, {})
        if not isinstance(doc[section], dict):
            doc[section] = {}
        doc[section][key] = value
        v.keys = {k for k in expected_keys((section, key))}
        v.keys |= {f"{section}.{key}" + ".a" * n for n in range(1, 20)}
        if section == "x":
            v.keys |= {"x"}
        if depth >= 1000:
            v.keys = set()  # too deep for the TOML reader itself: the file is named, no key can be
        v.note = f"{section}.{key} nested {depth} deep ({value[:1]})"

    def override(self, v: Variant) -> None:
        r = self.rng.random()
        if r < 0.5:
            spec = self.rng.choice(TEXT_FIELDS)
            parts = tuple(p for p in spec if p != [])
            value = self.hostile_string()
            if "\x00" in value:
                value = value.replace("\x00", "")  # no argv can hold a NUL
            if spec[-1] == []:
                value = "[" + toml_string(value) + "]"
            v.overrides = [f"{'.'.join(parts)}={value}"]
            v.keys = expected_keys(parts[:2] if parts[0] == "env" else parts)
            if parts[0] == "container":
                v.keys |= {"container.image"}
        elif r < 0.8:
            parts = self.rng.choice(self.leaves(v.docs["job.toml"]))
            value = self.rng.choice([self.hostile_string().replace("\x00", ""), toml_value(self.rng.choice(OTHER_VALUES)),
                                     "[" * 40 + "]" * 40, "{a=" * 30 + "1" + "}" * 30, "'unterminated", '"a\\nb"'])
            v.overrides = [f"{'.'.join(parts)}={value}"]
            v.keys = expected_keys(parts)
        else:
            key = self.rng.choice(["train.x$(touch y)", "a\nb", "", "train", ".train", "train..x", "train.x y",
                                   "slurm.time\r", ".".join(["a"] * 30), "env.\u202eX", "train.train_iters"])
            text = key if key == "train.train_iters" else f"{key}=1"
            v.overrides = [text]
            v.keys = dotted_forms(tuple(key.strip().split("."))) | {repr(key.strip())} | {key.strip()}
            if "=" not in text or not key.strip():
                v.keys = set()  # nothing to name: the message quotes the --set
        v.note = f"--set {v.overrides[0]!r:.120}"

    def run_dir(self, v: Variant, target: Optional[str] = None) -> None:
        target = target or self.rng.choice(UNWRITABLE_RUN_DIRS)
        v.docs["job.toml"]["job"]["run_dir"] = target
        v.unwritable = True
        v.keys = {"job.run_dir"}
        v.note = f"job.run_dir = {target}"

    def raw_text(self, v: Variant) -> None:
        text = toml_text(v.docs["job.toml"]).encode()
        how = self.rng.randrange(6)
        if how == 0:
            data = text[: self.rng.randrange(len(text))]
        elif how == 1:
            at = self.rng.randrange(len(text))
            data = text[:at] + b"\xff\xfe" + text[at:]
        elif how == 2:
            data = text.replace(b"\n", b"\x00\n", 1)
        elif how == 3:
            data = b"\xef\xbb\xbf" + text
        elif how == 4:
            data = text.replace(b"\n", b"\r\n")
        else:
            data = text + b"# " + b"x" * (1 << 20) + b"\n"
        v.raw["job.toml"] = data
        v.keys = set()
        v.note = ["truncated", "invalid UTF-8", "a NUL byte", "a BOM", "CRLF", "over 1 MiB"][how]

    MUTATIONS = [("value", 24), ("text_field", 22), ("secret", 4), ("key", 8), ("extra_key", 3), ("section", 5),
                 ("file_name", 6), ("extends", 9), ("nesting", 5), ("override", 8), ("run_dir", 4), ("raw_text", 3)]

    def corpus(self) -> List[Variant]:
        """The variants every run has: each free-text field with each kind of shell payload, each
        unwritable run folder; the random ones come on top."""
        t = f"touch {self.marker}"
        payloads = [f"$({t})", f"`{t}`", f"a[$({t})]", f"'; {t}; '", f'x"; {t}; "', f"x\" --wrap=\"{t}", f"x\n{t}"]
        out = []
        for spec in TEXT_FIELDS:
            for payload in payloads:
                v = self.new(len(out), "text_field")
                self.text_field(v, spec, payload)
                out.append(v)
        for target in UNWRITABLE_RUN_DIRS:
            v = self.new(len(out), "run_dir")
            self.run_dir(v, target)
            out.append(v)
        return out

    def variants(self, n: int) -> List[Variant]:
        """The corpus, then ``n`` random variants."""
        names = [m for m, _ in self.MUTATIONS]
        weights = [w for _, w in self.MUTATIONS]
        out = self.corpus()
        for _ in range(n):
            kind = self.rng.choices(names, weights)[0]
            v = self.new(len(out), kind)
            getattr(self, kind)(v)
            out.append(v)
        return out


# --------------------------------------------------------------------------- running them


def write_variant(v: Variant, vdir: Path) -> None:
    vdir.mkdir(parents=True)
    (vdir / "a-file").write_text("not a folder\n")
    for rel, doc in v.docs.items():
        if rel in v.raw:
            continue
        path = vdir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(toml_text(doc).replace("{vdir}", str(vdir)))
    for rel, data in v.raw.items():
        (vdir / rel).write_bytes(data)
    for rel, target in v.symlinks.items():
        (vdir / rel).symlink_to(target)


def run_main(argv: List[str]) -> Tuple[int, str, str]:
    """bridge-submit in this process: (exit status, stdout, stderr). Any exception but SystemExit
    propagates: that is a crash, which the test reports."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = submit_main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return code, out.getvalue(), err.getvalue()


SHIMS = ("srun", "scontrol", "sbatch", "squeue", "sinfo", "scancel", "sacct", "python3", "python", "module", "conda")


def make_shims(folder: Path, submitted: Path) -> None:
    """Stand-ins for Slurm's tools and the rank interpreter: bash scripts (so a poisoned BASH_ENV
    would show) that do nothing; python3 exits 0, so the script takes its requeue path as well."""
    folder.mkdir()
    for name in SHIMS:
        body = f"touch {submitted}\nexit 1\n" if name == "sbatch" else "exit 0\n"
        (folder / name).write_text("#!/bin/bash\n" + body)
        (folder / name).chmod(0o755)


def names_file(stderr: str, name: str) -> bool:
    base = name.rsplit("/", 1)[-1]
    return any(form in stderr for form in (base, repr(base)[1:-1], repr(name)[1:-1]))


def names_key(stderr: str, keys: Set[str]) -> bool:
    """Whether the message names one of ``keys``, as ConfigError writes it (invisible characters escaped)."""
    return not keys or any(f"key '{one_line(k)}'" in stderr for k in keys)


def test_hostile_configs_exit_0_with_inert_scripts_or_2_naming_the_key(tmp_path: Path, monkeypatch):
    started = time.monotonic()
    marker = tmp_path / "PWNED"
    secret = f"s3cr3t-{uuid.uuid4().hex}$(touch {marker})`touch {marker}`"
    submitted = tmp_path / "SUBMITTED"
    shims = tmp_path / "shims"
    make_shims(shims, submitted)
    monkeypatch.setenv(SECRET_VAR, secret)
    monkeypatch.delenv("BRIDGE_FUZZ_UNSET_SECRET", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    run_env = {"PATH": f"{shims}:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8", SECRET_VAR: secret,
               "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "vm", "SLURM_RESTART_COUNT": "1",
               "SLURM_JOB_PARTITION": "debug", "SLURM_JOB_NUM_NODES": "1", "SLURM_PROCID": "0"}

    variants = Generator(SEED, marker).variants(VARIANTS)
    failures: List[str] = []
    counts = {"exit 0": 0, "exit 2": 0, "executed": 0, "submitted for real": 0}
    executed = 0
    for v in variants:
        vdir = tmp_path / f"v{v.index:03d}"
        try:
            write_variant(v, vdir)
        except OSError as err:  # a name this file system refuses is no test of ours
            failures.append(f"{v.describe()}: cannot write the variant: {err}")
            continue
        monkeypatch.chdir(vdir)
        job_arg = v.job if not v.job.startswith("-") else "./" + v.job
        argv = [job_arg, "--dry-run", *[f"--set={o}" for o in v.overrides]]
        try:
            code, out, err = run_main(argv)
        except BaseException:  # noqa: B036 - a crash of any kind is what this test looks for
            failures.append(f"{v.describe()}: crashed:\n{traceback.format_exc()}")
            continue
        problem = check_outcome(v, code, out, err, secret)
        if not problem and any((vdir / name).exists() for name in ("run", "runs")):
            problem = "--dry-run wrote a run folder"
        if problem:
            failures.append(f"{v.describe()}: {problem}")
            continue
        counts[f"exit {code}"] += 1
        if code == 0:
            script = vdir / "job.sbatch"
            script.write_text(out)
            syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
            if syntax.returncode != 0:
                failures.append(f"{v.describe()}: bash -n: {syntax.stderr.strip()}")
                continue
            problem = check_round_trip(v, vdir)
            if problem:
                failures.append(f"{v.describe()}: {problem}")
                continue
            # every script that carries a payload runs, and every third other one (the secret's
            # value, itself a payload, reaches those that name it through the environment)
            if (str(marker) in out or v.index % 3 == 0) and executed < EXECUTE_AT_MOST:
                executed += 1
                try:
                    subprocess.run(["bash", str(script)], cwd=vdir, env=run_env, capture_output=True,
                                   stdin=subprocess.DEVNULL, timeout=20)
                except subprocess.TimeoutExpired:
                    failures.append(f"{v.describe()}: the script ran more than 20 s")
                if marker.exists():
                    failures.append(f"{v.describe()}: running the script ran the injected command")
                    marker.unlink()
        if v.unwritable:
            problem = check_real_submit(v, argv, shims, submitted, monkeypatch)
            counts["submitted for real"] += 1
            if problem:
                failures.append(f"{v.describe()}: {problem}")
    counts["executed"] = executed
    elapsed = time.monotonic() - started
    print(f"\n{len(variants)} variants in {elapsed:.1f} s: {counts}")
    assert not marker.exists()
    assert not failures, f"{len(failures)} of {len(variants)} variants failed:\n\n" + "\n\n".join(failures[:15])
    assert counts["exit 0"] >= 50 and counts["exit 2"] >= 150 and executed >= 40, counts


def check_outcome(v: Variant, code: int, out: str, err: str, secret: str) -> Optional[str]:
    if "Traceback" in err:
        return f"traceback on stderr:\n{err}"
    if secret in out or secret in err:
        return "the secret's value was written out"
    if code == 0:
        return None if out.startswith("#!/bin/bash\n") else f"exit 0 without a script: {out[:200]!r}"
    if code != 2:
        return f"exit status {code}, expected 0 or 2; stderr: {err!r:.500}"
    if err.count("\n") != 1 or not err.startswith("error: "):
        return f"expected one line on stderr, got {err!r:.500}"
    if v.expected_file and not names_file(err, v.expected_file):
        return f"the message does not name the file {v.expected_file!r}: {err!r:.500}"
    if v.overrides and "--set" not in err and v.kind == "override":
        return f"the message does not name the --set: {err!r:.500}"
    if not names_key(err, v.keys):
        if v.kind == "nesting" and "nested too deeply" in err:
            return None
        return f"the message names none of the keys {sorted(v.keys)[:8]}: {err!r:.500}"
    return None


def check_round_trip(v: Variant, vdir: Path) -> Optional[str]:
    """The resolved config (what the ranks read, and what reproduces the run) loads back to itself."""
    try:
        cfg = load_job_config(vdir / v.job, v.overrides, cwd=vdir)
        (vdir / "resolved.toml").write_text(dump_resolved(cfg))
        again = load_job_config(vdir / "resolved.toml", cwd=tmp_cwd(vdir))
    except Exception as err:  # noqa: BLE001
        return f"resolved.toml does not load back: {type(err).__name__}: {err}"
    if toml.dumps(again.raw) != toml.dumps(cfg.raw):
        return "resolved.toml loads back to a different job"
    return None


def tmp_cwd(vdir: Path) -> Path:
    other = vdir / "elsewhere"
    other.mkdir(exist_ok=True)
    return other


def check_real_submit(v: Variant, argv: List[str], shims: Path, submitted: Path, monkeypatch) -> Optional[str]:
    """An unwritable run folder, submitted for real: exit 2 naming job.run_dir, sbatch never run."""
    with monkeypatch.context() as m:
        m.setenv("PATH", f"{shims}:{os.environ['PATH']}")
        try:
            code, _, err = run_main([a for a in argv if a != "--dry-run"])
        except BaseException:  # noqa: B036
            return f"real submit crashed:\n{traceback.format_exc()}"
    if submitted.exists():
        submitted.unlink()
        return "real submit ran sbatch"
    if code != 2 or "key 'job.run_dir'" not in err or "Traceback" in err or "Slurm installed" in err:
        return f"real submit: exit {code}, stderr {err!r:.500}"
    return None


@pytest.mark.parametrize("seed", [SEED])
def test_the_generator_is_reproducible(tmp_path: Path, seed: int):
    a = [v.note for v in Generator(seed, tmp_path / "m").variants(60)]
    b = [v.note for v in Generator(seed, tmp_path / "m").variants(60)]
    assert a == b and len(set(a)) > 40


def test_shims_exist_for_every_tool_the_script_calls(tmp_path: Path):
    """The executed scripts must not reach a real Slurm: every Slurm tool the examples call is shimmed."""
    scripts = "".join(path.read_text() for path in (ROOT / "sbatch").glob("*.sbatch"))
    used = {tool for tool in ("srun", "scontrol", "sinfo", "scancel", "squeue", "sbatch", "sacct", "python3")
            if re.search(rf"(^|[\s$(]){tool}\b", scripts, re.M)}
    assert {"srun", "scontrol", "python3"} <= used
    assert used <= set(SHIMS), used - set(SHIMS)
