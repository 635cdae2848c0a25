"""``bridge-hf``: Hugging Face checkpoints in and out.

- ``bridge-hf import HF_DIR OUT [--transformer-impl local|transformer_engine]``: a Hugging Face folder
  (``config.json``, ``*.safetensors``) as a toolkit checkpoint folder, for ``checkpoint.pretrained_checkpoint``
  (converted once instead of at every start), built on the local layers or Transformer Engine's;
- ``bridge-hf export CHECKPOINT_DIR OUT_DIR``: a run's ``checkpoints/`` folder (its newest complete
  checkpoint) or one ``iter_NNNNNNN``, saved at any TP/PP layout, as a Hugging Face folder that
  ``transformers.AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer`` load.

``OUT`` must not exist; it appears complete or not at all, and nothing is overwritten: it is written
into a temporary folder of the tool's own beside it (``.OUT.tmp-XXXXXXXX``; an ``OUT.tmp`` of anyone's
is left alone), renamed at the end only if ``OUT`` is still absent
(:mod:`bridge_hpc.contracts.new_output`). Bad input (a folder without config.json, missing or truncated
shards, a tensor of the wrong shape, dtype or name, a checkpoint no family fits, a damaged checkpoint),
a full disk, or ``OUT`` made by another run meanwhile: one line naming the file (and tensor), exit
status 2. Ctrl-C or SIGTERM: one line saying ``OUT`` was not written, exit status 130, the temporary
folder removed. ``export`` of a run's folder whose newest checkpoint is damaged exports the newest one
that verifies and says so on stderr (``warning:``). Progress goes to stderr. torch is imported only
once the input has been checked.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Optional, Sequence

from bridge_hpc.contracts import new_output
from bridge_hpc.contracts.errors import ConfigError, exits_on_config_error
from bridge_hpc.contracts.text import has_control_chars, one_line
from bridge_hpc.training.process import compiler_imports, lazy_imports


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bridge-hf", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="a Hugging Face folder -> a toolkit checkpoint folder")
    imp.add_argument("hf_dir", metavar="HF_DIR")
    imp.add_argument("out", metavar="OUT")
    imp.add_argument("--transformer-impl", choices=("local", "transformer_engine"), default="local",
                     help="the layers the checkpoint is written from (default: local); transformer_engine needs a "
                          "GPU with Transformer Engine. Either loads into either (model.transformer_impl)")
    exp = sub.add_parser("export", help="a toolkit checkpoint -> a Hugging Face folder")
    exp.add_argument("checkpoint", metavar="CHECKPOINT_DIR")
    exp.add_argument("out", metavar="OUT_DIR")
    exp.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                     help="the saved tensors' dtype (default: the Hugging Face model the run started from, else the "
                          "checkpoint's)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    return p


def _check_paths(*paths: str, out: str) -> None:
    for path in paths + (out,):
        if has_control_chars(path):
            raise ConfigError("a path may not hold control characters (a newline, a tab, ...)", path=repr(path))
    for path in paths:
        if not os.path.exists(path):
            raise ConfigError("no such file or folder", path=path)
    if os.path.lexists(out):
        raise ConfigError("exists already: give a new folder (nothing is overwritten)", path=out)
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise ConfigError("cannot be created: its parent folder is missing or not writable", path=out)


def _progress(line: str, started: float = time.monotonic()) -> None:
    print(f"[bridge-hf {time.monotonic() - started:6.1f}s] {line}", file=sys.stderr, flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    try:
        with new_output.sigterm_as_interrupt():
            return _run(args)
    except KeyboardInterrupt:
        out = one_line(args.out)
        if new_output.was_published(args.out):
            print(f"bridge-hf: interrupted after {out} was written completely (it is kept)", file=sys.stderr)
        else:
            print(f"bridge-hf: interrupted: {out} was not written (nothing of it is left)", file=sys.stderr)
        # What is left is the interpreter's teardown: its garbage collections over torch's and
        # megatron-core's objects take seconds on a loaded machine; frozen objects are skipped.
        gc.freeze()
        return new_output.EXIT_INTERRUPTED


@exits_on_config_error
def _run(args: argparse.Namespace) -> int:
    if args.command == "import":
        _check_paths(args.hf_dir, out=args.out)
        from bridge_hpc.training.hf import mapping

        mapping.checked_model_config(args.hf_dir)  # before torch: a bad folder is refused at once
        lazy_imports.install()  # W&B, which megatron-core imports, loaded only if used
        with compiler_imports.deferred():  # megatron-core's import, as the ranks import it
            from bridge_hpc.models.hf.convert import import_folder

            summary = import_folder(args.hf_dir, args.out, _progress, transformer_impl=args.transformer_impl)
    else:
        _check_paths(args.checkpoint, out=args.out)
        from bridge_hpc.models.hf.export import export  # torch and safetensors: no megatron-core

        summary = export(args.checkpoint, args.out, args.dtype, _progress)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(" ".join(f"{k}={v}" for k, v in summary.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
