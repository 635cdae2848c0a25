"""The ranks' bytecode cache (bridge_hpc.training.process.bytecode_cache, ``[job] bytecode_cache``).

Each case runs a fresh interpreter, as a rank starts, on a package made here without bytecode
(standing in for a read-only torch install that came without it): with ``PYTHONDONTWRITEBYTECODE``
set, the first start compiles into the cache, a later start reads the same files, and the
processes a rank starts use the cache too. Where the package has its bytecode, where the user set a
prefix, or with ``off``, nothing changes. Bad values are refused naming the key.
"""

from __future__ import annotations

import compileall
import glob
import json
import os
import subprocess
import sys
import textwrap

import pytest
from bridge_test_helpers import TINY

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.jobfile.jobconfig import load_job_config

PROBE = textwrap.dedent("""
    import subprocess, sys
    from bridge_hpc.training.process.bytecode_cache import ensure_bytecode_cache
    print("in use:", ensure_bytecode_cache(sys.argv[1], packages=("nobytecode",)))
    import nobytecode.heavy
    child = "import nobytecode.heavy, sys; print('child prefix:', sys.pycache_prefix)"
    subprocess.run([sys.executable, "-c", child], check=True)
""")


@pytest.fixture
def package(tmp_path):
    root = tmp_path / "site"
    (root / "nobytecode").mkdir(parents=True)
    (root / "nobytecode" / "__init__.py").write_text("VALUE = 1\n")
    (root / "nobytecode" / "heavy.py").write_text("TABLE = [i * i for i in range(100)]\n")
    return root


def _start(package, setting, **env_changes):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(package), os.environ.get("PYTHONPATH", "")]),
               PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONPYCACHEPREFIX", None)
    env.update(env_changes)
    proc = subprocess.run([sys.executable, "-c", PROBE, setting], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _cached(cache) -> dict:
    return {path: os.stat(path).st_mtime_ns for path in glob.glob(f"{cache}/**/*.pyc", recursive=True)}


def test_a_package_without_bytecode_is_compiled_once_into_the_cache(package, tmp_path):
    cache = tmp_path / "cache"
    out = _start(package, str(cache))
    assert f"in use: {cache}" in out and f"child prefix: {cache}" in out
    first = _cached(cache)
    # The cache holds the package's two modules (and whatever else the interpreter imported without
    # bytecode: in a virtual environment, the editable install's finder).
    names = sorted(os.path.basename(p).split(".")[0] for p in first if f"{package}{os.sep}" in p)
    assert names == ["__init__", "heavy"], first
    assert not list(package.rglob("__pycache__")), "nothing is written next to the read-only sources"

    out = _start(package, str(cache))  # a requeued run: the same files are read, not written again
    assert f"in use: {cache}" in out
    assert _cached(cache) == first


def test_auto_uses_the_user_cache_folder(package, tmp_path):
    out = _start(package, "auto", XDG_CACHE_HOME=str(tmp_path / "xdg"))
    folder = tmp_path / "xdg" / "bridge_hpc" / "pycache"
    assert f"in use: {folder}" in out and _cached(folder)


def test_nothing_changes_where_bytecode_exists_or_is_not_wanted(package, tmp_path):
    cache = tmp_path / "cache"
    assert "in use: None" in _start(package, "off")
    own = tmp_path / "own-prefix"
    out = _start(package, str(cache), PYTHONPYCACHEPREFIX=str(own))
    assert "in use: None" in out and f"child prefix: {own}" in out
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert "in use: None" in _start(package, str(blocked / "cache"))  # cannot be made: warned, imports as before
    assert compileall.compile_dir(str(package), quiet=1)
    assert "in use: None" in _start(package, str(cache))
    assert not cache.exists()




def _load(tmp_path, value: str):
    job = tmp_path / "job.toml"
    job.write_text(open(TINY).read())
    return load_job_config(str(job), [f"job.bytecode_cache={json.dumps(value)}"])


@pytest.mark.parametrize("value", ["relative/cache", "", "/", "$(touch /tmp/x)", "/tmp/a\nb"])
def test_a_bad_bytecode_cache_is_refused_naming_the_key(tmp_path, value):
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, value)
    assert err.value.key == "job.bytecode_cache" and str(tmp_path / "job.toml") in err.value.format()


@pytest.mark.parametrize("value", ["auto", "off", "~/pycache", "/scratch/me/pycache"])
def test_good_bytecode_cache_values_are_kept(tmp_path, value):
    assert _load(tmp_path, value).job.bytecode_cache == value
