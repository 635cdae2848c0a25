"""scripts/check_commit_subjects.py against a real git repository: `make lint` and the commit-msg hook."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "check_commit_subjects.py"


def git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                          capture_output=True, text=True)


def commit(repo: Path, subject: str) -> subprocess.CompletedProcess:
    (repo / "f").write_text(subject)
    git(repo, "add", "f")
    return git(repo, "commit", "-q", "-m", subject + "\n\nbody line that may be as long as it likes " * 3)


def test_lint_check_passes_on_this_repository():
    assert subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT).returncode == 0


def test_lint_and_hook_refuse_a_long_subject(tmp_path):
    repo = tmp_path / "r"
    repo.mkdir()
    git(repo, "init", "-q")
    commit(repo, "x" * 73)  # older than the rule: a shallow history without RULE_SINCE checks every commit
    result = subprocess.run([sys.executable, str(SCRIPT)], cwd=repo, capture_output=True, text=True)
    assert result.returncode == 1 and "73 characters" in result.stderr, result.stderr

    hook = repo / ".git" / "hooks" / "commit-msg"
    shutil.copy(ROOT / "scripts" / "commit-msg", hook)
    (repo / "scripts").mkdir()
    shutil.copy(SCRIPT, repo / "scripts" / SCRIPT.name)
    refused = commit(repo, "y" * 80)
    assert refused.returncode != 0 and "80 characters" in refused.stderr, refused.stderr
    assert commit(repo, "area: a subject that fits").returncode == 0
    assert git(repo, "log", "-1", "--format=%s").stdout.strip() == "area: a subject that fits"
