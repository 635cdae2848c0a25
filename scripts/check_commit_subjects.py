"""Commit subjects of at most 72 characters (CONTRIBUTING.md, "Commits").

Two uses, one rule:
- ``make lint`` runs it without arguments: every commit since :data:`RULE_SINCE` (the last commit
  before the rule was checked; older subjects stay as they are) must have a subject of at most
  :data:`MAX_SUBJECT` characters;
- ``scripts/commit-msg`` (installed by ``make hooks`` as ``.git/hooks/commit-msg``) runs it with the
  message file git hands the hook, and refuses the commit before it is made.
Exit 0 when every subject fits, 1 naming each one that does not.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

MAX_SUBJECT = 72
#: The newest commit whose subject is not checked: the rule is checked from its child on.
RULE_SINCE = "953118d"


def subject_of_message(text: str) -> str:
    """The subject git will record: the first line that is not blank or a comment."""
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            return line.rstrip()
    return ""


def subjects_since(base: str) -> List[Tuple[str, str]]:
    """(short hash, subject) of each commit after ``base`` on HEAD; all of HEAD's when ``base`` is not
    in this clone's history (a shallow clone)."""
    known = subprocess.run(["git", "cat-file", "-e", f"{base}^{{commit}}"], capture_output=True).returncode == 0
    revs = f"{base}..HEAD" if known else "HEAD"
    out = subprocess.run(["git", "log", "--format=%h%x00%s", revs], capture_output=True, text=True, check=True).stdout
    return [tuple(line.split("\0", 1)) for line in out.splitlines() if line]


def too_long(subjects: List[Tuple[str, str]]) -> List[str]:
    return [f"{ref}: {len(s)} characters: {s}" for ref, s in subjects if len(s) > MAX_SUBJECT]


def main(argv: List[str]) -> int:
    if argv:
        subjects = [("this commit", subject_of_message(Path(argv[0]).read_text(errors="replace")))]
    else:
        subjects = subjects_since(RULE_SINCE)
    wrong = too_long(subjects)
    for line in wrong:
        print(f"commit subject over {MAX_SUBJECT} characters (CONTRIBUTING.md): {line}", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
