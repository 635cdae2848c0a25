"""Render every example in configs/ into sbatch/ (run after changing a template or an example).

The examples are rendered as if submitted from /scratch/bridge, so the files do not depend on where
the repository was cloned; tests/test_examples.py fails when these files fall behind the templates.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bridge_hpc.jobfile.jobconfig import load_job_config  # noqa: E402
from bridge_hpc.launch.render import render_script  # noqa: E402

SUBMIT_DIR = Path("/scratch/bridge")
EXAMPLES = ["configs/local-tiny.toml", "configs/local-tiny-fault-tolerance.toml", "configs/gpt-126m-h100.toml"]


def rendered_examples():
    """(output path, script text) for each example, rendered with paths relative to the repository."""
    import os

    here = os.getcwd()
    os.chdir(ROOT)
    try:
        for rel in EXAMPLES:
            cfg = load_job_config(rel, cwd=SUBMIT_DIR)
            yield ROOT / "sbatch" / (Path(rel).stem + ".sbatch"), render_script(cfg)
    finally:
        os.chdir(here)


if __name__ == "__main__":
    for path, text in rendered_examples():
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")
