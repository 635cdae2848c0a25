"""Hostile flags, file names and file contents through ``bridge-prepare-data`` (issue 25's fuzz item).

A seeded generator (reproducible: ``SEED``) makes ``VARIANTS`` variants of one small, good run. Each
changes one thing: an input file's name (newlines, ``$(…)``, backticks, ``%``, quotes, a leading dash,
undecodable bytes, 255 bytes), its contents (control characters, lone surrogates, invalid UTF-8, a
huge line, an empty file, blank lines only, truncated or fake gzip, deep nesting, a byte-order mark,
CRLF), or a flag (``--output-prefix``, ``--json-keys``, ``--workers``, ``--vocab-size``,
``--tokenizer-model``, ``--on-bad-line``), locally or with ``--slurm``. Every variant must either

- exit 0 with a correct shard: read back through megatron-core, token for token what the tokenizer
  makes of the documents the variant holds (less the bad lines, with ``--on-bad-line skip``), its
  files matching their record; with ``--slurm``, scripts that pass ``bash -n`` and, executed with
  Slurm's commands and the interpreter shimmed, run nothing injected; or
- exit 2 with one ``error:`` line on stderr, no traceback, naming the flag or the file the variant
  changed.

The CLI runs in-process (its ``main``), so that a variant costs milliseconds rather than an interpreter.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import random
import subprocess
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple

import pytest
from bridge_test_helpers import MINIMAL_TRAINING_TOML, ROOT
from test_prepare_data import byte_level, expected, read_back

from bridge_hpc.cli.prepare_data import main
from bridge_hpc.contracts.text import one_line
from bridge_hpc.prepare import shards as prepare

SEED = 25  # issue 25
VARIANTS = 600
SHIMS = ("srun", "scontrol", "sbatch", "squeue", "sinfo", "scancel", "sacct", "python3", "python")


def payload(marker: Path) -> List[str]:
    """Strings that run ``touch marker`` wherever they reach a shell unquoted."""
    return [f"$(touch {marker})", f"`touch {marker}`", f"x\ntouch {marker}\n#", f"x; touch {marker}",
            f"x' ; touch {marker} ; '", f'x" ; touch {marker} ; "']


HOSTILE_TEXT = ["\x00", "\x1b[31m", "\r", "\u2028", "\u202e", "\ufeff", "%j%x%%", "$HOME", "\\", "'\"", "-",
                "--help", "日本語", "😀", " ", "\t"]


@dataclass
class Variant:
    index: int
    what: str
    #: The flag or file the variant changed: an exit 2 must name it.
    blame: str
    #: input file name -> raw bytes
    files: dict = field(default_factory=dict)
    #: the documents (texts) an accepted run must hold, per input file, in order
    docs: dict = field(default_factory=dict)
    flags: List[str] = field(default_factory=list)
    prefix: str = "out/p"
    slurm: bool = False
    must_refuse: bool = False

    def describe(self) -> str:
        return f"variant {self.index} ({self.what!r})"


def line(text) -> bytes:
    return (json.dumps({"text": text}) + "\n").encode()


class Generator:
    def __init__(self, seed: int, marker: Path):
        self.rng = random.Random(seed)
        self.marker = marker
        self.good_docs = ["a first document", "the second one, with ümlauts", "3"]

    def base(self, index: int, what: str, blame: str) -> Variant:
        v = Variant(index, what, blame)
        v.files = {"a.jsonl": b"".join(line(d) for d in self.good_docs)}
        v.docs = {"a.jsonl": list(self.good_docs)}
        return v

    def file_name(self, index: int) -> Variant:
        name = self.rng.choice(payload(self.marker) + HOSTILE_TEXT + ["-x", "a b", "x" * 240, "\udcff\udcfe",
                                                                       "..", "%A_%a"]) + ".jsonl"
        v = self.base(index, f"input named {name!r}", name)
        v.files = {name: v.files.pop("a.jsonl")}
        v.docs = {name: v.docs.pop("a.jsonl")}
        v.slurm = self.rng.random() < 0.4
        return v

    def contents(self, index: int) -> Variant:
        kind = self.rng.choice(["control", "surrogate", "invalid-utf8", "huge-line", "empty", "blank", "truncated-gz",
                                "fake-gz", "good-gz", "deep", "bom", "crlf", "nul", "not-object", "big-number",
                                "null-text", "payload-text"])
        v = self.base(index, f"contents: {kind}", "a.jsonl")
        good = b"".join(line(d) for d in self.good_docs)
        skip = self.rng.random() < 0.5
        if skip:
            v.flags += ["--on-bad-line", "skip"]
        if kind == "control":
            text = "".join(self.rng.choice(HOSTILE_TEXT) for _ in range(8))
            v.files["a.jsonl"] = good + line(text)
            v.docs["a.jsonl"] = self.good_docs + [text]
        elif kind == "payload-text":
            text = self.rng.choice(payload(self.marker))
            v.files["a.jsonl"] = good + line(text)
            v.docs["a.jsonl"] = self.good_docs + [text]
        elif kind in ("surrogate", "invalid-utf8", "deep", "nul", "not-object", "null-text"):
            bad = {"surrogate": b'{"text": "x\\ud800y"}\n', "invalid-utf8": b'{"text": "\xff\xfe"}\n',
                   "deep": b'{"text": ' + b"[" * 100000 + b"]" * 100000 + b"}\n", "nul": b'{"text": "a"}\x00\n',
                   "not-object": b'["text"]\n', "null-text": b'{"text": null}\n'}[kind]
            v.files["a.jsonl"] = good + bad
            v.must_refuse = not skip
        elif kind == "huge-line":
            text = "y" * (4 << 20)
            v.files["a.jsonl"] = good + line(text)
            v.docs["a.jsonl"] = self.good_docs + [text]
        elif kind in ("empty", "blank"):
            v.files["a.jsonl"] = b"" if kind == "empty" else b"\n\n  \n"
            v.must_refuse = True
        elif kind == "truncated-gz":
            data = gzip.compress(good * 50)
            v.files = {"a.jsonl.gz": data[: len(data) // 2]}
            v.blame, v.must_refuse = "a.jsonl.gz", True
        elif kind == "fake-gz":
            v.files = {"a.jsonl.gz": good}
            v.blame, v.must_refuse = "a.jsonl.gz", True
        elif kind == "good-gz":
            v.files = {"a.jsonl.gz": gzip.compress(good)}
            v.docs = {"a.jsonl.gz": list(self.good_docs)}
            v.blame = "a.jsonl.gz"
        elif kind == "bom":  # a UTF-8 byte-order mark starts the file: json reads through it
            v.files["a.jsonl"] = b"\xef\xbb\xbf" + good
        elif kind == "crlf":
            v.files["a.jsonl"] = good.replace(b"\n", b"\r\n")
        elif kind == "big-number":
            v.files["a.jsonl"] = good + b'{"text": "z", "n": 1e999999}\n'
            v.docs["a.jsonl"] = self.good_docs + ["z"]
        return v

    def flag(self, index: int) -> Variant:
        flag = self.rng.choice(["--output-prefix", "--json-keys", "--workers", "--vocab-size", "--tokenizer-model",
                                "--slurm-prefix"])
        hostile = self.rng.choice(payload(self.marker) + HOSTILE_TEXT + ["", "/proc/x/p", "/sys/p", "/dev/null/p",
                                                                         "x" * 300])
        v = self.base(index, f"{flag} {hostile!r}", flag)
        if flag in ("--output-prefix", "--slurm-prefix"):
            v.prefix = "out/" + hostile if not hostile.startswith("/") else hostile
            v.slurm = flag == "--slurm-prefix"
            v.blame = "--output-prefix"
        elif flag == "--json-keys":
            v.flags += ["--json-keys", hostile]
            v.must_refuse = True  # no line has that key
        elif flag == "--workers":
            number = self.rng.choice(["0", "-1", "100000", "1e3", hostile])
            v.flags += ["--workers", number]
            v.what = f"--workers {number!r}"
        elif flag == "--vocab-size":
            v.flags += ["--tokenizer-type", "NullTokenizer", "--vocab-size", self.rng.choice(["0", "-5", "x", hostile])]
            v.must_refuse = True
        elif flag == "--tokenizer-model":
            v.flags += ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", hostile or "x"]
            v.must_refuse = True
        return v

    def variants(self, n: int) -> List[Variant]:
        makers = [self.file_name, self.contents, self.contents, self.flag]
        return [self.rng.choice(makers)(i) for i in range(n)]


def run_main(argv: List[str]) -> Tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse: exit 2 with its usage and one error line
            code = exc.code if isinstance(exc.code, int) else 1
    return code, out.getvalue(), err.getvalue()


def names(err_line: str, blame: str) -> bool:
    base = blame.rsplit("/", 1)[-1]
    return any(form in err_line for form in {blame, base, one_line(base), repr(base)[1:-1], one_line(blame)})


def check_refusal(v: Variant, code: int, out: str, err: str) -> Optional[str]:
    errors = [ln for ln in err.splitlines() if ln.startswith("error:") or ": error:" in ln]
    if len(errors) != 1:
        return f"exit 2 with {len(errors)} error lines: {err!r}"
    if not names(errors[0], v.blame):
        return f"the error does not name {v.blame!r}: {errors[0]!r}"
    if out:
        return f"printed on stdout: {out!r}"
    return None


def check_shard(v: Variant, vdir: Path, out: str) -> Optional[str]:
    prefix = (vdir / v.prefix) if not v.prefix.startswith("/") else Path(v.prefix)
    tokenizer = byte_level()
    for name, docs in v.docs.items():
        shard = prepare.shard_name(Path(name))
        got = read_back(prepare.dataset_prefix(str(prefix.absolute()), shard, "text"))
        if got != expected(tokenizer, docs, append_eod=False):
            return f"shard {shard} holds other tokens than its documents"
        record = prepare.load_record(str(prefix.absolute()), shard)
        for path, size, digest, _, _ in record.outputs["text"].files():
            if prepare._sha256_file(Path(path)) != digest or os.path.getsize(path) != size:
                return f"{path} does not match its record"
    if "[dataset]" not in out:
        return "no [dataset] snippet on stdout"
    return None


def make_shims(folder: Path, captured: Path) -> None:
    """sbatch keeps the script it is given and answers as Slurm does; the others do nothing."""
    folder.mkdir()
    for name in SHIMS:
        if name == "sbatch":
            body = (f'n=$(ls {captured} | wc -l); cp "${{@: -1}}" {captured}/$n.sbatch; '
                    'echo "Submitted batch job $((4000 + n))"\n')
        else:
            body = "exit 0\n"
        (folder / name).write_text("#!/bin/bash\n" + body)
        (folder / name).chmod(0o755)


def test_hostile_flags_names_and_contents_exit_0_with_correct_shards_or_2_naming_the_input(tmp_path, monkeypatch):
    started = time.monotonic()
    marker = tmp_path / "PWNED"
    shims, captured = tmp_path / "shims", tmp_path / "captured"
    captured.mkdir()
    make_shims(shims, captured)
    monkeypatch.setenv("PATH", f"{shims}:{os.environ['PATH']}")
    job = tmp_path / "job.toml"
    job.write_text(f'extends = "{ROOT / "configs" / "clusters" / "local.toml"}"\n[job]\nname = "fuzz"\n'
                   f'run_dir = "{tmp_path / "run"}"\n' + MINIMAL_TRAINING_TOML)
    run_env = {"PATH": f"{shims}:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8", "SLURM_JOB_ID": "4242",
               "SLURM_ARRAY_TASK_ID": "0", "SLURM_JOB_NODELIST": "vm", "SLURM_RESTART_COUNT": "0"}
    failures: List[str] = []
    counts = {"exit 0": 0, "exit 2": 0, "scripts executed": 0, "names no file system takes": 0}
    for v in Generator(SEED, marker).variants(VARIANTS):
        vdir = tmp_path / f"v{v.index:03d}"
        vdir.mkdir()
        try:
            for name, data in v.files.items():
                (vdir / name).write_bytes(data)
        except (OSError, ValueError):  # a name no file system takes (a NUL) is no test of ours
            counts["names no file system takes"] += 1
            continue
        monkeypatch.chdir(vdir)
        inputs = ["./" + name for name in v.files]
        argv = ["--input", *inputs, "--output-prefix", v.prefix, "--tokenizer-type", "ByteLevelTokenizer", *v.flags]
        if "--tokenizer-type" in v.flags:
            argv = ["--input", *inputs, "--output-prefix", v.prefix, *v.flags]
        if v.slurm:
            argv += ["--slurm", str(job)]
        before = set(captured.iterdir())
        try:
            code, out, err = run_main(argv)
        except BaseException:  # noqa: B036 - a crash of any kind is what this test looks for
            failures.append(f"{v.describe()}: crashed:\n{traceback.format_exc()}")
            continue
        problem = None
        if "Traceback" in err:
            problem = f"a traceback: {err}"
        elif code == 2:
            problem = check_refusal(v, code, out, err)
        elif code != 0:
            problem = f"exit {code}: {err!r}"
        elif v.must_refuse:
            problem = f"accepted what must be refused: {err!r}"
        elif not v.slurm:
            problem = check_shard(v, vdir, out)
        if problem:
            failures.append(f"{v.describe()}: {problem}")
            continue
        counts[f"exit {code}"] += 1
        for script in sorted(set(captured.iterdir()) - before):
            syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
            if syntax.returncode != 0:
                failures.append(f"{v.describe()}: bash -n {script.name}: {syntax.stderr.strip()}")
                continue
            subprocess.run(["bash", str(script)], cwd=vdir, env=run_env, capture_output=True,
                           stdin=subprocess.DEVNULL, timeout=30)
            counts["scripts executed"] += 1
        if marker.exists():
            failures.append(f"{v.describe()}: an injected command ran")
            marker.unlink()
    elapsed = time.monotonic() - started
    print(f"{VARIANTS} variants in {elapsed:.0f} s: {counts}")
    assert not failures, f"{len(failures)} of {VARIANTS} variants failed:\n" + "\n".join(failures[:20])
    assert counts["exit 0"] >= VARIANTS // 5 and counts["exit 2"] >= VARIANTS // 5, counts
    assert counts["scripts executed"] >= 10, counts


@pytest.mark.parametrize("argv, flag", [
    (["--output-prefix"], "--output-prefix"),
    (["--tokenizer-type", "NoSuchTokenizer"], "--tokenizer-type"),
    (["--on-bad-line", "ignore"], "--on-bad-line"),
    (["--workers", "many"], "--workers"),
])
def test_argparse_errors_name_the_flag_without_a_traceback(tmp_path, argv, flag):
    """The parser's own refusals: exit 2 and an error line naming the flag."""
    (tmp_path / "a.jsonl").write_bytes(line("x"))
    args = ["--input", str(tmp_path / "a.jsonl"), "--output-prefix", str(tmp_path / "o"),
            "--tokenizer-type", "ByteLevelTokenizer"]
    code, out, err = run_main(args + argv)
    assert code == 2 and out == "" and "Traceback" not in err
    assert flag in [ln for ln in err.splitlines() if "error:" in ln][0]
