"""Job configs on the login node: validation, profiles, overrides, rendering and quoting.

Bad input is checked through the real command (``python -m bridge_hpc.cli.submit``): exit status 2,
one message naming the file and the key, no traceback, nothing written.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import toml

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.launch.jobconfig import load_job_config
from bridge_hpc.launch.render import render_script
from jobs import MINIMAL_TRAINING, MINIMAL_TRAINING_TOML

ROOT = Path(__file__).resolve().parent.parent


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def submit_cli(*args: str, cwd: Path, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bridge_hpc.cli.submit", *args], cwd=cwd, capture_output=True, text=True,
        env=env, timeout=60,
    )


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

    from bridge_hpc.training.run import load_forward_step  # the rank side (imports no torch itself)

    assert load_forward_step(cfg.job.forward_step)(None, None, None) == "mine"
    assert load_forward_step("bridge_hpc.training.gpt:forward_step").__module__ == "bridge_hpc.training.gpt"
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
    assert "-m bridge_hpc.training.run" in result.stdout
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
    from bridge_hpc.launch.jobconfig import dump_resolved
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
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'nvidia_resiliency_ext')]\n"
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
