"""Installing the Debian packages the local cluster runs on, when they are missing.

The check is by binary, not by package: an admin may have built Slurm or MariaDB from source, and what
``bridge-cluster up`` needs is that every command below can be run. Only when one is missing does it call
apt-get (needs root and a package mirror), since an install takes about a minute.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, List

from bridge_hpc.local_slurm.errors import ClusterError

APT_PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge", "slurmdbd", "mariadb-server"]
# binaries that prove the packages are there
REQUIRED_BINARIES = [
    "slurmctld", "slurmd", "slurmdbd", "sbatch", "squeue", "sinfo", "scontrol", "sacct", "sacctmgr",
    "munged", "munge", "unmunge", "mariadbd", "mariadb-install-db", "mariadb", "mariadb-admin",
]


def missing_binaries() -> List[str]:
    """The required binaries found neither on PATH nor in /usr/sbin (root's PATH may lack /usr/sbin)."""
    return [b for b in REQUIRED_BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]


def ensure_packages(say: Callable[[str], None]) -> None:
    """Install :data:`APT_PACKAGES` with apt-get when a required binary is missing; a no-op otherwise.

    Raises :class:`ClusterError` when apt-get is absent or fails, or when the binaries are still missing
    after the install (a package that does not ship what it used to).
    """
    missing = missing_binaries()
    if not missing:
        return
    if shutil.which("apt-get") is None:
        raise ClusterError(
            f"Slurm is not installed (missing: {', '.join(missing)}) and apt-get is not available; "
            f"install {' '.join(APT_PACKAGES)} by hand"
        )
    say(f"missing {', '.join(missing)}: installing {' '.join(APT_PACKAGES)} with apt-get (about a minute)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for argv in (["apt-get", "update"], ["apt-get", "install", "-y", *APT_PACKAGES]):
        say("$ " + " ".join(argv))
        sys.stdout.flush()
        rc = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL).returncode  # apt shows progress
        if rc != 0:
            raise ClusterError(f"`{' '.join(argv)}` failed with exit status {rc}")
    still = missing_binaries()
    if still:
        raise ClusterError(f"after apt-get install these are still missing: {', '.join(still)}")
