"""The fast-path record: which speed settings a job runs with, and why the others are off.

bridge-submit decides them for a job on GPUs (:mod:`bridge_hpc.training.engine.speed_defaults`) and writes the
record into resolved.toml as ``[job] fast_path``; the ranks read resolved.toml with the same loader,
get the record on their ``ConfigContainer.fast_path``, settle what only a rank can tell (CUDA, triton,
the world it runs in) and rank 0 logs :meth:`FastPath.line` as a run starts. Defined here because it
crosses from the login node to the ranks. Standard library only.
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Tuple

#: resolved.toml's key: ``[job] fast_path``.
TOML_KEY = "fast_path"
#: The line rank 0 logs as a run starts begins so (tests and log readers look for it).
LINE_PREFIX = "fast path: "


class FastPath(NamedTuple):
    """What the fast path chose for one job. A NamedTuple, not a dataclass: it rides on the
    ``ConfigContainer`` without being one of its config sections.

    ``chosen``: every fast-path key whose fast value is in force (set by the job, by this resolution,
    or the field's own default). ``set_here``: those of them the job file left unset and the
    resolution set (what a re-read resolved.toml treats as unset again, and what a rank that cannot
    run one turns back off). ``not_chosen``: ``(key, why)`` for every other fast-path key.
    """

    gpus: bool
    chosen: Tuple[str, ...]
    set_here: Tuple[str, ...]
    not_chosen: Tuple[Tuple[str, str], ...]

    def line(self) -> str:
        """The one log line: ``fast path: chosen A, B; not chosen: C, D (why), E (why)`` (keys with the
        same reason share it)."""
        chosen = ", ".join(self.chosen) or "nothing"
        by_reason: Dict[str, list] = {}
        for key, why in self.not_chosen:
            by_reason.setdefault(why, []).append(key)
        not_chosen = "; ".join(f"{', '.join(keys)} ({why})" for why, keys in by_reason.items()) or "nothing"
        return f"{LINE_PREFIX}chosen {chosen}; not chosen: {not_chosen}"

    def to_toml(self) -> Dict[str, Any]:
        """The ``[job] fast_path`` table."""
        return {"gpus": self.gpus, "chosen": list(self.chosen), "set_here": list(self.set_here),
                "not_chosen": {key: why for key, why in self.not_chosen}}

    @classmethod
    def from_toml(cls, table: Any) -> "FastPath":
        """Read a ``[job] fast_path`` table back; ValueError saying what is wrong with it."""
        if not isinstance(table, dict) or set(table) != {"gpus", "chosen", "set_here", "not_chosen"}:
            raise ValueError("expected the table bridge-submit writes: gpus, chosen, set_here and not_chosen "
                             "(leave it out of a job file)")
        lists = [table["chosen"], table["set_here"]]
        if (not isinstance(table["gpus"], bool) or not all(isinstance(x, list) and all(isinstance(k, str) for k in x)
                                                           for x in lists)
                or not isinstance(table["not_chosen"], dict)
                or not all(isinstance(v, str) for v in table["not_chosen"].values())):
            raise ValueError("expected gpus = true/false, chosen and set_here lists of keys, not_chosen a table "
                             "of key = reason")
        return cls(table["gpus"], tuple(table["chosen"]), tuple(table["set_here"]),
                   tuple(table["not_chosen"].items()))
