"""Job configs on the login node: validation, profiles, overrides, rendering and quoting.

Bad input is checked through the real command (``python -m bridge_hpc.cli.submit``): exit status 2,
one message naming the file and the key, no traceback, nothing written.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import toml
from bridge_test_helpers import MINIMAL_TRAINING, MINIMAL_TRAINING_TOML, submit_cli

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.jobfile.jobconfig import load_job_config
from bridge_hpc.launch.render import render_script

ROOT = Path(__file__).resolve().parent.parent


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    write(tmp_path / "clusters" / "cpu.toml", """
        [cluster]
        name = "cpu"
        partitions = ["debug", "urgent"]
        gpus_per_node = 0
        cpus_per_node = 4

        [slurm]
        partition = "debug"
        time = "00:30:00"
        account = "from-profile"

        [env]
        FROM_PROFILE = "1"
    """)
    write(tmp_path / "job.toml", """
        extends = "clusters/cpu.toml"

        [job]
        name = "exp"

        [slurm]
        ntasks_per_node = 2
        time = "00:10:00"

        [train]
        train_iters = 10
        micro_batch_size = 1
        global_batch_size = 2

        [optimizer]
        lr = 1e-3
    """)
    return tmp_path


BAD_INPUTS = [
    # (what is wrong, job file text, key the message must name, a phrase it must contain)
    ("unknown key", '[slurm]\nparition = "debug"\n', "slurm.parition", "did you mean 'partition'"),
    ("unknown section", '[slrum]\ntime = "00:10:00"\n', "slrum", "did you mean 'slurm'"),
    ("wrong type", '[slurm]\nnodes = "two"\n', "slurm.nodes", "expected an integer"),
    ("bad time", '[slurm]\ntime = "90 minutes"\n', "slurm.time", "HH:MM:SS"),
    ("bad minutes", '[slurm]\ntime = "00:75:00"\n', "slurm.time", "HH:MM:SS"),
    ("bad signal", '[slurm]\nsignal = "USR9@60"\n', "slurm.signal", "SIGNAL[@seconds]"),
    ("signal after the end", '[slurm]\ntime = "00:01:00"\nsignal = "USR1@120"\n', "slurm.signal", "slurm.time"),
    ("gpus on a CPU profile", '[slurm]\ngpus_per_node = 4\n', "slurm.gpus_per_node", "has no GPUs"),
    ("partition not in profile", '[slurm]\npartition = "gpu"\n', "slurm.partition", "not a partition"),
    ("too many cpus", '[slurm]\nntasks_per_node = 8\n', "slurm.ntasks_per_node", "exceed"),
    ("newline in a value", '[job]\nname = "a\\nb"\n', "job.name", "newlines"),
    ("bad env name", '[env]\n"1X" = "y"\n', "env.1X", "not a valid environment variable name"),
    ("extra sets an owned option", '[slurm]\nextra = { output = "/tmp/x" }\n', "slurm.extra.output", "set by bridge_hpc"),
    ("container without image", '[container]\nmounts = ["/a:/b"]\n', "container.image", "needs an image"),
    ("unknown training key", '[train]\ntrain_itres = 5\n', "train.train_itres", "did you mean 'train_iters'"),
    ("wrong training type", '[model]\nnum_layers = "two"\n', "model.num_layers", "expected an integer"),
    ("in-process restart timeouts out of order", MINIMAL_TRAINING_TOML + '[inprocess_restart]\nsoft_timeout = 100\n',
     "inprocess_restart.hard_timeout", "must be > inprocess_restart.soft_timeout"),
    ("forward_step without a function", '[job]\nforward_step = "mypkg.steps"\n', "job.forward_step",
     "'package.module:function'"),
    ("forward_step file missing", '[job]\nforward_step = "steps/nope.py:forward_step"\n', "job.forward_step",
     "does not exist"),
    ("forward_step bad module", '[job]\nforward_step = "my-pkg/steps:forward_step"\n', "job.forward_step",
     "'path/to/file.py:function'"),
    # issue 9: what the fuzz test (tests/test_config_fuzz.py) found
    ("a variable bash expands at start-up", '[env]\nBASH_ENV = "$(touch /tmp/x)"\n', "env.BASH_ENV", "may not set it"),
    ("a variable the script computes with", '[env]\nSLURM_RESTART_COUNT = "a[$(touch /tmp/x)]"\n',
     "env.SLURM_RESTART_COUNT", "may not set it"),
    ("bridge_hpc's own variable", '[env]\nBRIDGE_CONFIG = "/tmp/x.toml"\n', "env.BRIDGE_CONFIG", "may not set it"),
    ("not a number", '[optimizer]\nlr = nan\n', "optimizer.lr", "finite"),
    ("beyond 64 bits", '[train]\ntrain_iters = 18446744073709551616\n', "train.train_iters", "64-bit"),
    ("an sbatch pattern in the run folder", '[job]\nrun_dir = "runs/100%j"\n', "job.run_dir", "'%'"),
    ("nested too deeply", '[train]\nx = ' + "[" * 20 + "]" * 20 + "\n", "train.x", "nested too deeply"),
    ("an invisible character in a key", '[train]\n"train_iters\u200b" = 1\n', "train.'train_iters\\u200b'",
     "invisible"),
    ("a table where a value goes", '[cluster]\nmax_time = { a = 1 }\n', "cluster.max_time",
     "expected a string"),
]


@pytest.mark.parametrize("what,text,key,phrase", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_exits_2_naming_file_and_key(tmp_path: Path, what, text, key, phrase):
    write(tmp_path / "clusters" / "cpu.toml", '[cluster]\nname="cpu"\npartitions=["debug"]\ngpus_per_node=0\ncpus_per_node=4\n')
    job = write(tmp_path / "job.toml", 'extends = "clusters/cpu.toml"\n' + text)
    result = submit_cli("job.toml", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert f"key '{key}'" in result.stderr
    assert "job.toml" in result.stderr
    assert phrase in result.stderr
    assert result.stderr.count("\n") == 1  # one message
    assert not (tmp_path / "runs").exists()
    assert job.exists()


def test_forward_step_file_is_written_absolute_and_loads_on_the_ranks(tmp_path: Path):
    write(tmp_path / "steps" / "mine.py", "def forward_step(state, data_iterator, model):\n    return 'mine'\n")
    write(tmp_path / "job.toml", '[job]\nforward_step = "steps/mine.py:forward_step"\n' + MINIMAL_TRAINING_TOML)
    cfg = load_job_config(tmp_path / "job.toml", cwd=tmp_path)
    assert cfg.job.forward_step == f"{tmp_path / 'steps' / 'mine.py'}:forward_step"
    assert cfg.raw["job"]["forward_step"] == cfg.job.forward_step  # resolved.toml: from any directory

    from bridge_hpc.rank import load_forward_step  # the rank side (imports no torch itself)

    assert load_forward_step(cfg.job.forward_step)(None, None, None) == "mine"
    import importlib

    gpt = importlib.import_module("bridge_hpc.training.engine.model")  # (it may re-export the step from another module)
    assert load_forward_step("bridge_hpc.training.engine.model:forward_step") is gpt.forward_step
    with pytest.raises(ConfigError, match="has no function 'other'") as err:
        load_forward_step(f"{tmp_path / 'steps' / 'mine.py'}:other", source="job.toml")
    assert err.value.key == "job.forward_step" and err.value.path == "job.toml"
    with pytest.raises(ConfigError, match="no_such_module"):
        load_forward_step("no_such_module:forward_step")


def test_unreadable_toml_names_the_line(tmp_path: Path):
    write(tmp_path / "job.toml", '[job]\nname = "x"\n[slurm]\ntime = 00:10\n')
    result = submit_cli("job.toml", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "job.toml" in result.stderr and "line 4" in result.stderr


def test_missing_file_and_missing_profile(tmp_path: Path):
    result = submit_cli("nope.toml", cwd=tmp_path)
    assert result.returncode == 2 and "nope.toml" in result.stderr and "does not exist" in result.stderr
    write(tmp_path / "job.toml", 'extends = "clusters/missing.toml"\n')
    result = submit_cli("job.toml", cwd=tmp_path)
    assert result.returncode == 2 and "key 'extends'" in result.stderr and "missing.toml" in result.stderr


def test_profile_cycle_is_reported(tmp_path: Path):
    write(tmp_path / "a.toml", 'extends = "b.toml"\n')
    write(tmp_path / "b.toml", 'extends = "a.toml"\n')
    result = submit_cli("a.toml", cwd=tmp_path)
    assert result.returncode == 2 and "cycle" in result.stderr


def test_error_in_inherited_key_names_the_profile(tmp_path: Path):
    write(tmp_path / "clusters" / "p.toml", '[slurm]\ntime = "soon"\n')
    write(tmp_path / "job.toml", 'extends = "clusters/p.toml"\n')
    result = submit_cli("job.toml", cwd=tmp_path)
    assert result.returncode == 2
    assert "clusters/p.toml" in result.stderr and "key 'slurm.time'" in result.stderr


def test_bad_override_names_the_override(job_dir: Path):
    result = submit_cli("job.toml", "--dry-run", "--set", "slurm.nodes=many", cwd=job_dir)
    assert result.returncode == 2 and "--set slurm.nodes" in result.stderr and "expected an integer" in result.stderr


def test_profile_inheritance_and_overrides_resolve_in_order(job_dir: Path):
    cfg = load_job_config(job_dir / "job.toml", ["slurm.time=02:00:00", "train.train_iters=500", "env.EXTRA=yes"], cwd=job_dir)
    assert cfg.slurm.partition == "debug"  # from the profile
    assert cfg.slurm.account == "from-profile"
    assert cfg.slurm.ntasks_per_node == 2  # from the job file
    assert cfg.slurm.time == "02:00:00"  # job file said 00:10:00, profile 00:30:00: --set wins
    assert cfg.training.train.train_iters == 500
    assert {v.name: v.value for v in cfg.env} == {"FROM_PROFILE": "1", "EXTRA": "yes"}
    assert cfg.run_dir == job_dir / "runs" / "exp"
    # The resolved document is what the ranks read: profiles merged, no 'extends' left.
    assert "extends" not in cfg.raw and cfg.raw["slurm"]["account"] == "from-profile"


def test_dry_run_prints_the_script_and_writes_nothing(job_dir: Path):
    result = submit_cli("job.toml", "--dry-run", cwd=job_dir)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("#!/bin/bash\n#SBATCH --job-name=exp\n")
    assert "#SBATCH --partition=debug" in result.stdout and "#SBATCH --time=00:10:00" in result.stdout
    assert "#SBATCH --signal=USR1@120" in result.stdout and "#SBATCH --requeue" in result.stdout
    assert "-m bridge_hpc.rank" in result.stdout
    assert not (job_dir / "runs").exists()


INJECTIONS = ["x$(touch /tmp/pwned)", "a`touch /tmp/pwned`b", "it's \"quoted\"; rm -rf ~", "$HOME ${PATH} \\n"]


@pytest.mark.parametrize("evil", INJECTIONS)
def test_values_reach_the_shell_quoted(tmp_path: Path, evil: str):
    """Parse the rendered script with shlex as bash would: each value must come out as one literal word."""
    doc = {"job": {"name": evil}, "env": {"EVIL": evil}, "setup": {"modules": [evil]}, **MINIMAL_TRAINING}
    (tmp_path / "job.toml").write_text(toml.dumps(doc))
    script = render_script(load_job_config(tmp_path / "job.toml", cwd=tmp_path))
    lines = script.splitlines()
    export = next(line for line in lines if line.startswith("export EVIL="))
    assert shlex.split(export) == ["export", f"EVIL={evil}"]
    module = next(line for line in lines if line.startswith("module load"))
    assert shlex.split(module) == ["module", "load", evil]
    # bash itself agrees: run the export line and print the value back.
    out = subprocess.run(["bash", "-c", export + '\nprintf %s "$EVIL"'], capture_output=True, text=True)
    assert out.stdout == evil


def test_secrets_are_named_never_written(tmp_path: Path):
    write(tmp_path / "job.toml", """
        [env]
        API_KEY = { from_shell = "MY_SECRET_TOKEN" }
    """ + MINIMAL_TRAINING_TOML)
    env = dict(os.environ, MY_SECRET_TOKEN="s3cr3t-value")
    result = submit_cli("job.toml", "--dry-run", cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    assert "s3cr3t-value" not in result.stdout
    assert 'export API_KEY="${MY_SECRET_TOKEN}"' in result.stdout
    cfg = load_job_config(tmp_path / "job.toml", cwd=tmp_path)
    from bridge_hpc.jobfile.jobconfig import dump_resolved
    assert "s3cr3t-value" not in dump_resolved(cfg)


def test_missing_secret_stops_submission(tmp_path: Path):
    write(tmp_path / "job.toml", '[env]\nAPI_KEY = { from_shell = "BRIDGE_TEST_UNSET_SECRET" }\n' + MINIMAL_TRAINING_TOML)
    env = {k: v for k, v in os.environ.items() if k != "BRIDGE_TEST_UNSET_SECRET"}
    result = submit_cli("job.toml", cwd=tmp_path, env=env)
    assert result.returncode == 2 and "key 'env.API_KEY'" in result.stderr
    assert "BRIDGE_TEST_UNSET_SECRET" in result.stderr and not (tmp_path / "runs").exists()


def test_login_node_path_imports_no_torch(job_dir: Path):
    code = (
        "import sys; from bridge_hpc.cli.submit import main; import bridge_hpc.launch.submit, bridge_hpc.local_slurm.cluster; "
        "import bridge_hpc.cli.status, bridge_hpc.cli.report\n"
        "main(['job.toml', '--dry-run'])\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'nvidia_resiliency_ext', 'wandb', "
        "'mlflow', 'comet_ml')]\n"
        "assert not heavy, heavy"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=job_dir, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_straggler_node_exclusion_can_be_switched_off(job_dir: Path):
    on = render_script(load_job_config(job_dir / "job.toml", cwd=job_dir))
    off = render_script(load_job_config(job_dir / "job.toml", ["slurm.exclude_straggler_nodes=false"], cwd=job_dir))
    assert "exclude_nodes()" in on and 'exclude_nodes "$id" "$2"' in on
    assert "exclude_nodes" not in off and "ExcNodeList" not in off
    for script in (on, off):  # either way the script stays valid bash
        assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_sbatch_examples_match_the_templates():
    sys.path.insert(0, str(ROOT / "tests"))
    from render_examples import rendered_examples

    for path, text in rendered_examples():
        assert path.exists(), f"{path} missing: run python tests/render_examples.py"
        assert path.read_text() == text, f"{path} is stale: run python tests/render_examples.py and review the diff"


def test_templates_ship_in_a_non_editable_install(tmp_path: Path):
    """Build a wheel and check the templates are inside, where render.py's PackageLoader looks."""
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    import zipfile

    (wheel,) = tmp_path.glob("bridge_hpc-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for template in ("job.sbatch.j2", "parts/header.sbatch.j2", "parts/launch.sh.j2", "parts/env.sh.j2", "parts/setup.sh.j2"):
        assert f"bridge_hpc/templates/{template}" in names
    # every module of the source tree is in the wheel (setup.cfg lists packages by hand)
    for module in (ROOT / "bridge_hpc").rglob("*.py"):
        assert module.relative_to(ROOT).as_posix() in names, module
    # and the installed wheel renders, away from the source tree
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    env = dict(os.environ, PYTHONPATH=str(target))
    code = ("import bridge_hpc, sys; assert bridge_hpc.__file__.startswith(sys.argv[1]), bridge_hpc.__file__; "
            "from bridge_hpc.cli.submit import main; sys.exit(main(['configs/local-tiny.toml', '--dry-run']))")
    out = subprocess.run([sys.executable, "-c", code, str(target)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("#!/bin/bash\n#SBATCH --job-name=local-tiny")


# --------------------------------------------------------------------------- the run folder at submission
# Real submits (not --dry-run) against stand-ins for Slurm's tools: nothing here reaches a real Slurm.


def slurm_shims(folder: Path) -> Path:
    """``sbatch`` records its call and answers with the next job id (4242, 4243, ...); ``squeue``
    records its call and prints what the test wrote to ``squeue.out``; ``srun`` does nothing."""
    folder.mkdir(parents=True)
    (folder / "sbatch").write_text(
        '#!/bin/bash\nhere=$(dirname "$0")\necho "$@" >> "$here/sbatch.calls"\n'
        'id=$(cat "$here/next_id" 2>/dev/null || echo 4242)\necho $((id + 1)) > "$here/next_id"\n'
        'echo "Submitted batch job $id"\n')
    (folder / "squeue").write_text('#!/bin/bash\nhere=$(dirname "$0")\necho "$@" >> "$here/squeue.calls"\n'
                                   'cat "$here/squeue.out" 2>/dev/null\nexit 0\n')
    (folder / "srun").write_text("#!/bin/bash\nexit 0\n")  # submitit looks for it before it submits
    for tool in ("sbatch", "squeue", "srun"):
        (folder / tool).chmod(0o755)
    return folder


def calls(shims: Path, tool: str) -> list:
    path = shims / f"{tool}.calls"
    return path.read_text().splitlines() if path.exists() else []


def folder_bytes(folder: Path) -> dict:
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture
def read_only_dir(tmp_path: Path):
    """A folder on a read-only file system: a tmpfs mounted here, then remounted read-only (as root,
    permissions would not stop a write; a read-only mount does)."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root, or no CAP_SYS_ADMIN)")
    try:
        if subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True).returncode != 0:
            pytest.skip("cannot remount a tmpfs read-only here")
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.parametrize("where", ["/etc/passwd/x", "/proc/bridge-test/run", "read-only", "read-only/sub/run", "a-file/x"])
def test_unwritable_run_dir_exits_2_naming_it(tmp_path: Path, where: str, request):
    """A real submit whose run folder cannot be made or written: one message naming job.run_dir and the
    file, exit 2, no traceback, no 'is Slurm installed?' hint, nothing submitted."""
    if where.startswith("read-only"):
        ro = request.getfixturevalue("read_only_dir")
        run_dir = str(ro) + where[len("read-only"):]
    elif where.startswith("a-file"):
        (tmp_path / "a-file").write_text("not a folder\n")
        run_dir = str(tmp_path / where)
    else:
        run_dir = where
    shims = slurm_shims(tmp_path / "shims")
    write(tmp_path / "job.toml", f'[job]\nrun_dir = "{run_dir}"\n' + MINIMAL_TRAINING_TOML)
    env = dict(os.environ, PATH=f"{shims}:{os.environ['PATH']}")
    result = submit_cli("job.toml", cwd=tmp_path, env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and "Slurm installed" not in result.stderr
    assert result.stderr.count("\n") == 1 and "job.toml" in result.stderr
    assert "key 'job.run_dir'" in result.stderr and run_dir in result.stderr
    assert calls(shims, "sbatch") == []


def test_the_slurm_hint_is_given_only_when_sbatch_is_missing(tmp_path: Path):
    write(tmp_path / "job.toml", MINIMAL_TRAINING_TOML)
    empty = tmp_path / "empty-path"
    empty.mkdir()
    env = dict(os.environ, PATH=str(empty))
    result = submit_cli("job.toml", cwd=tmp_path, env=env)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "is Slurm installed?" in result.stderr and "sbatch" in result.stderr
    assert not (tmp_path / "runs").exists()  # nothing written for a submit that cannot happen
    # a path problem is not a missing Slurm, even without sbatch: the run folder is checked first
    result = submit_cli("job.toml", "--set", "job.run_dir=/proc/bridge-test/run", cwd=tmp_path, env=env)
    assert result.returncode == 2 and "key 'job.run_dir'" in result.stderr
    assert "Slurm installed" not in result.stderr and "Traceback" not in result.stderr


def test_dry_run_names_an_unset_secret(tmp_path: Path):
    """--dry-run checks what a real submit checks: a from_shell secret the shell does not have."""
    write(tmp_path / "job.toml", '[env]\nAPI_KEY = { from_shell = "BRIDGE_TEST_UNSET_SECRET" }\n' + MINIMAL_TRAINING_TOML)
    env = {k: v for k, v in os.environ.items() if k != "BRIDGE_TEST_UNSET_SECRET"}
    result = submit_cli("job.toml", "--dry-run", cwd=tmp_path, env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "key 'env.API_KEY'" in result.stderr and "BRIDGE_TEST_UNSET_SECRET" in result.stderr
    assert "job.toml" in result.stderr and result.stderr.count("\n") == 1 and result.stdout == ""
    # set, it is named in the script and its value is written nowhere
    result = submit_cli("job.toml", "--dry-run", cwd=tmp_path, env=dict(env, BRIDGE_TEST_UNSET_SECRET="v4lue-$(x)"))
    assert result.returncode == 0, result.stderr
    assert "v4lue" not in result.stdout and 'export API_KEY="${BRIDGE_TEST_UNSET_SECRET}"' in result.stdout


def test_a_secret_declared_in_a_profile_is_blamed_on_the_profile(tmp_path: Path):
    write(tmp_path / "p.toml", '[env]\nTOKEN = { from_shell = "BRIDGE_TEST_UNSET_SECRET" }\n')
    write(tmp_path / "job.toml", 'extends = "p.toml"\n' + MINIMAL_TRAINING_TOML)
    env = {k: v for k, v in os.environ.items() if k != "BRIDGE_TEST_UNSET_SECRET"}
    result = submit_cli("job.toml", "--dry-run", cwd=tmp_path, env=env)
    assert result.returncode == 2 and "p.toml: key 'env.TOKEN'" in result.stderr


def test_a_busy_run_folder_is_refused_with_the_job_id(tmp_path: Path):
    """While a job of the run folder is pending or running, another submit is refused naming it, and
    nothing in the folder changes; --force submits anyway; a finished job lets the next one in."""
    shims = slurm_shims(tmp_path / "shims")
    write(tmp_path / "job.toml", MINIMAL_TRAINING_TOML)
    env = dict(os.environ, PATH=f"{shims}:{os.environ['PATH']}")
    run_dir = tmp_path / "runs" / "job"
    first = submit_cli("job.toml", cwd=tmp_path, env=env)
    assert first.returncode == 0 and first.stdout.startswith("Submitted job 4242"), first.stdout + first.stderr
    assert [json.loads(line)["job_id"] for line in (run_dir / "jobs.jsonl").read_text().splitlines()] == ["4242"]

    for state in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING", "SUSPENDED"):
        (shims / "squeue.out").write_text(f"4242|4242|{state}\n")
        before = folder_bytes(run_dir)
        busy = submit_cli("job.toml", cwd=tmp_path, env=env)
        assert busy.returncode == 2, busy.stdout + busy.stderr
        assert "Traceback" not in busy.stderr and busy.stderr.count("\n") == 1
        assert "key 'job.run_dir'" in busy.stderr and "4242" in busy.stderr and state in busy.stderr
        assert str(run_dir) in busy.stderr and "--force" in busy.stderr
        assert folder_bytes(run_dir) == before  # job.sbatch, resolved.toml, jobs.jsonl untouched
        assert len(calls(shims, "sbatch")) == 1
    assert calls(shims, "squeue")[-1].split()[:3] == ["-h", "-j", "4242"]

    # a different config aimed at the busy folder is refused too, and --dry-run never asks Slurm
    asked = len(calls(shims, "squeue"))
    assert submit_cli("job.toml", "--set", "train.train_iters=2", cwd=tmp_path, env=env).returncode == 2
    assert submit_cli("job.toml", "--dry-run", cwd=tmp_path, env=env).returncode == 0
    assert len(calls(shims, "squeue")) == asked + 1

    forced = submit_cli("job.toml", "--force", cwd=tmp_path, env=env)
    assert forced.returncode == 0 and forced.stdout.startswith("Submitted job 4243"), forced.stdout + forced.stderr
    # both live now (an array task counts for its array): the refusal names the newest
    (shims / "squeue.out").write_text("4242|4242|RUNNING\n4243|4243_1|PENDING\n")
    busy = submit_cli("job.toml", cwd=tmp_path, env=env)
    assert busy.returncode == 2 and "4243" in busy.stderr and "1 more" in busy.stderr
    assert calls(shims, "squeue")[-1].split()[:3] == ["-h", "-j", "4242,4243"]
    # finished (or forgotten by the controller): the folder is free again, and resumes
    (shims / "squeue.out").write_text("4242|4242|COMPLETED\n4243|4243|CANCELLED by 0\n")
    again = submit_cli("job.toml", cwd=tmp_path, env=env)
    assert again.returncode == 0 and again.stdout.startswith("Submitted job 4244"), again.stderr
    (shims / "squeue.out").write_text("")
    assert submit_cli("job.toml", cwd=tmp_path, env=env).returncode == 0
    assert not list(run_dir.glob("job.sbatch.*"))  # the same job: one script


def test_two_submits_at_the_same_time_submit_one_job(tmp_path: Path):
    """Two bridge-submit of one config started together: the run folder is locked from the check to the
    record in jobs.jsonl, so the second sees the first's job and is refused (sbatch takes a second here)."""
    shims = slurm_shims(tmp_path / "shims")
    sbatch = (shims / "sbatch").read_text()
    (shims / "sbatch").write_text(sbatch.replace('echo "$@"', 'sleep 1\necho "$@"'))
    (shims / "squeue.out").write_text("4242|4242|PENDING\n")
    write(tmp_path / "job.toml", MINIMAL_TRAINING_TOML)
    env = dict(os.environ, PATH=f"{shims}:{os.environ['PATH']}")
    (tmp_path / "runs" / "job").mkdir(parents=True)  # both find the folder there already
    procs = [subprocess.Popen([sys.executable, "-m", "bridge_hpc.cli.submit", "job.toml"], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=60), p.stdout.read(), p.stderr.read()) for p in procs]
    assert sorted(code for code, _, _ in results) == [0, 2], results
    refused = next(err for code, _, err in results if code == 2)
    assert "job 4242" in refused and "key 'job.run_dir'" in refused
    assert len(calls(shims, "sbatch")) == 1


def _issue_9_job(folder: Path, name: str, head: str) -> Path:
    path = folder / name
    path.write_text(head + MINIMAL_TRAINING_TOML)
    return path


ISSUE_9_HOSTILE = [
    # (what the issue found, file name, text before the training sections, key named, phrase)
    ("a newline and $(...) in a key of [slurm] extra", "job.toml",
     '[slurm.extra]\n"reservation\\n$(touch INJECTED)" = "x"\n', "slurm.extra.", "newlines"),
    ("an [env] name ending in a newline", "job.toml", '[env]\n"API_KEY\\n" = { from_shell = "HOME" }\n', "env.", "newlines"),
    ("deeply nested TOML", "job.toml", "[train]\nx = " + "[" * 2000 + "]" * 2000 + "\n", None, "nested too deeply"),
    ("a home folder of no user", "job.toml", '[job]\nrun_dir = "~nosuchuser/x"\n', "job.run_dir", "no such user"),
    ("extends naming a binary file", "job.toml", 'extends = "/bin/ls"\n', "extends", "not a text file"),
    ("extends naming /proc", "job.toml", 'extends = "/proc/self/status"\n', "extends", "not valid TOML"),
    ("a file name with a newline and $(...), job.name unset", "evil\n$(touch INJECTED).toml", "", None, "file name"),
]


@pytest.mark.parametrize("what,name,head,key,phrase", ISSUE_9_HOSTILE, ids=[h[0] for h in ISSUE_9_HOSTILE])
def test_hostile_inputs_found_in_issue_9_exit_2_and_run_nothing(tmp_path: Path, what, name, head, key, phrase):
    """Each hole the issue lists: one line naming the file (and the key), exit 2, no traceback, no script
    and nothing run (the payloads would create INJECTED in the folder they run in)."""
    if name == "job.toml" and head.startswith("[train]"):
        path = tmp_path / name
        path.write_text(head.replace("[train]\n", "[train]\ntrain_iters = 1\nmicro_batch_size = 1\nglobal_batch_size = 1\n")
                        + "[optimizer]\nlr = 1e-3\n")
    else:
        path = _issue_9_job(tmp_path, name, head)
    for argv in (["--dry-run"], []):
        result = submit_cli(str(path), *argv, cwd=tmp_path)
        assert result.returncode == 2, result.stdout + result.stderr
        assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1, result.stderr
        assert phrase in result.stderr and (key is None or f"key '{key}" in result.stderr), result.stderr
    assert not (tmp_path / "INJECTED").exists() and not (tmp_path / "runs").exists()


def test_a_newline_in_an_env_name_given_by_set_is_refused(tmp_path: Path):
    path = _issue_9_job(tmp_path, "job.toml", "")
    result = submit_cli(str(path), "--dry-run", "--set", "env.API_KEY\n=secret", cwd=tmp_path)
    assert result.returncode == 2 and "key 'env.API_KEY'" in result.stderr and "newlines" in result.stderr, result.stderr
    assert "secret" not in result.stdout


def test_a_job_file_without_training_sections_loads_for_its_slurm_side_only(tmp_path):
    """``bridge-prepare-data --slurm`` reuses a job file's profile, partition and [setup]: such a file
    needs no training sections, but a training run still does, and sections that are there are checked."""
    profile = ROOT / "configs" / "clusters" / "local.toml"
    write(tmp_path / "prep.toml", f'extends = "{profile}"\n[job]\nname = "prep"\n[setup]\nmodules = ["gcc"]\n')
    cfg = load_job_config(tmp_path / "prep.toml", cwd=tmp_path, training=False)
    assert cfg.training is None
    assert cfg.slurm.partition == "debug" and cfg.setup.modules == ["gcc"]
    with pytest.raises(ConfigError, match="train.train_iters"):
        load_job_config(tmp_path / "prep.toml", cwd=tmp_path)
    write(tmp_path / "bad.toml", f'extends = "{profile}"\n[train]\nmicro_batch_size = 0\n')
    with pytest.raises(ConfigError, match="train"):
        load_job_config(tmp_path / "bad.toml", cwd=tmp_path, training=False)


def test_a_job_writes_the_progress_log_unless_it_says_otherwise(tmp_path: Path):
    """bridge-report reads progress.txt: a job writes it by default (Bridge's default, off, suits a
    script, not a job); ``log_progress = false`` still turns it off, and resolved.toml records which."""
    write(tmp_path / "job.toml", MINIMAL_TRAINING_TOML)
    cfg = load_job_config(tmp_path / "job.toml", cwd=tmp_path)
    assert cfg.training.logger.log_progress is True and cfg.raw["logger"]["log_progress"] is True
    off = load_job_config(tmp_path / "job.toml", overrides=["logger.log_progress=false"], cwd=tmp_path)
    assert off.training.logger.log_progress is False and off.raw["logger"]["log_progress"] is False


@pytest.mark.parametrize("overrides, expected", [((), "unset"), (("env.MASTER_PORT='23456'",), "23456")])
def test_a_rendezvous_port_of_the_submitting_shell_does_not_reach_the_ranks(job_dir, overrides, expected):
    """Slurm's --export=ALL carries the submitting shell's variables into the job: a MASTER_PORT there would
    be shared by every job that shell submits, and two of them on one node would bind the same port. The
    script unsets it before [env], which may still set one on purpose."""
    script = render_script(load_job_config(job_dir / "job.toml", list(overrides), cwd=job_dir))
    start = script.index("# --- environment")
    part = script[start:script.index("\n# ---", start + 1)]
    env = {**os.environ, "MASTER_PORT": "28484", "MASTER_ADDR": "10.0.0.9"}
    out = subprocess.run(["bash", "-c", part + '\necho "${MASTER_PORT-unset} ${MASTER_ADDR-unset}"'], env=env,
                         capture_output=True, text=True).stdout.split()
    assert out == [expected, "unset"]
