"""Issue 36, item 4: a secret written as a literal in a job file is refused at submission.

``[env] WANDB_API_KEY = "..."`` would be written into job.sbatch (under its own comment "secrets are
named, never written here") and resolved.toml, as ``logger.comet_api_key`` would be, which is refused
for that reason. Every well-known secret name (``*_API_KEY``, ``*_TOKEN``, ...) and a cluster profile's
own (``[cluster] secret_env_names``) must come as ``{ from_shell = "NAME" }``: bridge-submit, dry run or
not, exits 2 with one line naming the file, the key and that form, and writes and submits nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from bridge_test_helpers import MINIMAL_TRAINING_TOML, submit_cli

SECRET = "sk-LITERAL-SECRET-36"


def slurm_shims(folder: Path) -> Path:
    """``sbatch`` that records that it ran and answers with a job id; ``srun`` and ``squeue`` that do nothing."""
    folder.mkdir()
    (folder / "sbatch").write_text(f'#!/bin/bash\ntouch "{folder}/SUBMITTED"\necho "Submitted batch job 4242"\n')
    for tool in ("srun", "squeue"):
        (folder / tool).write_text("#!/bin/bash\nexit 0\n")
    for tool in ("sbatch", "srun", "squeue"):
        (folder / tool).chmod(0o755)
    return folder


def refused(tmp_path: Path, *args: str, key: str, file: str = "job.toml", env=None) -> str:
    """bridge-submit ARGS, dry run and real (sbatch shimmed): exit 2, one line naming ``file`` and ``key``,
    no traceback, the value never echoed, nothing written or submitted. Returns the real submit's line."""
    shims = tmp_path / "shims"
    if not shims.exists():
        slurm_shims(shims)
    env = dict(os.environ if env is None else env, PATH=f"{shims}:{os.environ['PATH']}")
    for dry in (["--dry-run"], []):
        result = submit_cli(*args, *dry, cwd=tmp_path, env=env)
        assert result.returncode == 2, result.stdout + result.stderr
        err = result.stderr
        assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("error: "), err
        assert file in err and f"key '{key}'" in err, err
        assert SECRET not in err and SECRET not in result.stdout
        assert not (tmp_path / "runs").exists() and not (shims / "SUBMITTED").exists()
    return err


@pytest.mark.parametrize("name", ["WANDB_API_KEY", "HF_TOKEN", "MLFLOW_TRACKING_TOKEN", "COMET_API_KEY",
                                  "OPENAI_API_KEY", "GITHUB_TOKEN", "API_KEY", "wandb_api_key"])
def test_a_literal_secret_in_env_is_refused_pointing_at_from_shell(tmp_path: Path, name: str):
    (tmp_path / "job.toml").write_text(f'[env]\n{name} = "{SECRET}"\n' + MINIMAL_TRAINING_TOML)
    err = refused(tmp_path, "job.toml", key=f"env.{name}")
    assert f'{{ from_shell = "{name}" }}' in err and "job.sbatch" in err


@pytest.mark.parametrize("value", ["12345", "['a']", '""'])
def test_any_literal_value_of_a_secret_is_refused(tmp_path: Path, value: str):
    """A number, a list, an empty string: none is { from_shell = ... }; nothing else may follow."""
    (tmp_path / "job.toml").write_text(f"[env]\nHF_TOKEN = {value}\n" + MINIMAL_TRAINING_TOML)
    refused(tmp_path, "job.toml", key="env.HF_TOKEN")


def test_a_literal_secret_in_a_profile_is_blamed_on_the_profile(tmp_path: Path):
    (tmp_path / "site.toml").write_text(f'[env]\nWANDB_API_KEY = "{SECRET}"\n')
    (tmp_path / "job.toml").write_text('extends = "site.toml"\n' + MINIMAL_TRAINING_TOML)
    err = refused(tmp_path, "job.toml", key="env.WANDB_API_KEY", file="site.toml")
    assert f"{tmp_path / 'site.toml'}: key 'env.WANDB_API_KEY'" in err


def test_a_literal_secret_given_by_set_is_refused(tmp_path: Path):
    (tmp_path / "job.toml").write_text(MINIMAL_TRAINING_TOML)
    err = refused(tmp_path, "job.toml", "--set", f"env.WANDB_API_KEY={SECRET}", key="env.WANDB_API_KEY")
    assert "(--set env.WANDB_API_KEY)" in err and '{ from_shell = "WANDB_API_KEY" }' in err
    # the from_shell form through --set is taken, and the script names the variable, not its value
    env = dict(os.environ, WANDB_API_KEY=SECRET)
    ok = submit_cli("job.toml", "--dry-run", "--set", 'env.WANDB_API_KEY={ from_shell = "WANDB_API_KEY" }',
                    cwd=tmp_path, env=env)
    assert ok.returncode == 0, ok.stderr
    assert SECRET not in ok.stdout and "WANDB_API_KEY" in ok.stdout


def test_a_profile_adds_its_own_secret_names(tmp_path: Path):
    """``[cluster] secret_env_names`` in a cluster profile: names (``*`` for any text) refused as literals
    like the well-known ones, and taken as { from_shell = ... }."""
    (tmp_path / "site.toml").write_text('[cluster]\nname = "site"\nsecret_env_names = ["MY_SITE_PASSWORD", "VAULT_*"]\n')
    for name in ("MY_SITE_PASSWORD", "VAULT_ROLE_ID"):
        (tmp_path / "job.toml").write_text(f'extends = "site.toml"\n[env]\n{name} = "{SECRET}"\n' + MINIMAL_TRAINING_TOML)
        err = refused(tmp_path, "job.toml", key=f"env.{name}")
        assert "cluster.secret_env_names" in err and f'{{ from_shell = "{name}" }}' in err
    (tmp_path / "job.toml").write_text('extends = "site.toml"\n[env]\nMY_SITE_PASSWORD = { from_shell = "PW" }\n'
                                       'SITE_NAME = "not a secret"\n' + MINIMAL_TRAINING_TOML)
    ok = submit_cli("job.toml", "--dry-run", cwd=tmp_path, env=dict(os.environ, PW=SECRET))
    assert ok.returncode == 0, ok.stderr
    assert SECRET not in ok.stdout and 'export MY_SITE_PASSWORD="${PW}"' in ok.stdout


@pytest.mark.parametrize("names", ['"MY_TOKEN"', '["MY TOKEN"]', "[5]", '["$(touch x)"]'])
def test_a_bad_secret_names_list_is_refused_naming_it(tmp_path: Path, names: str):
    (tmp_path / "site.toml").write_text(f"[cluster]\nsecret_env_names = {names}\n")
    (tmp_path / "job.toml").write_text('extends = "site.toml"\n[env]\nX = "1"\n' + MINIMAL_TRAINING_TOML)
    refused(tmp_path, "job.toml", key="cluster.secret_env_names", file="site.toml")
    assert not (tmp_path / "x").exists()


def test_what_is_no_secret_passes(tmp_path: Path):
    """A name that only contains TOKEN, and a boolean switch whose name ends in _TOKEN, are no secrets."""
    (tmp_path / "job.toml").write_text('[env]\nTOKENIZERS_PARALLELISM = "false"\nHF_HUB_DISABLE_IMPLICIT_TOKEN = true\n'
                                       'MY_TOKEN_FILE = "/run/secrets/token"\n' + MINIMAL_TRAINING_TOML)
    ok = submit_cli("job.toml", "--dry-run", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "export HF_HUB_DISABLE_IMPLICIT_TOKEN=true" in ok.stdout and "TOKENIZERS_PARALLELISM=false" in ok.stdout
