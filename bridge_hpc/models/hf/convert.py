"""A Hugging Face folder -> a toolkit checkpoint (``bridge-hf import``; one process, torch).

The model is built whole (TP1/PP1) in a world of one, the folder's weights are read into it
(:mod:`bridge_hpc.training.hf.load`) and saved by the toolkit's own model back end into
``OUT/iter_0000000`` with its manifest, run_config.json and tracker: a complete checkpoint that
``checkpoint.pretrained_checkpoint`` accepts. On a GPU that is megatron-core's sharded format, whose
global tensors load at any TP/PP layout; on CPU the CPU back end's (CPU runs have no model
parallelism).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Dict

import torch

from bridge_hpc.contracts.new_output import new_output_folder
from bridge_hpc.training.hf import families, mapping

#: The seed of the model a tool builds: its initial values are overwritten by the folder's tensors,
#: so any seed does; a fixed one keeps a tool's run reproducible.
TOOL_SEED = 1234


def _world_of_one() -> None:
    """The process state a model build needs, as a rank has it: a process group of one, megatron-core's
    parallel state (TP1/PP1) and its RNG trackers. On a GPU megatron-core's layers draw their initial
    weights from the model-parallel CUDA RNG tracker; a tool that never seeded it crashed there
    ("cuda rng state model-parallel-rng is not added") on every machine with a GPU."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from bridge_hpc.slurm.job_environment import unused_local_port
    from bridge_hpc.training.pretrain import set_random_seed

    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(unused_local_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    set_random_seed(TOOL_SEED)


def import_folder(hf_dir: str, out_dir: str, progress: Callable[[str], None] = lambda line: None,
                  transformer_impl: str = "local") -> Dict[str, Any]:
    """Write the Hugging Face model in ``hf_dir`` as a toolkit checkpoint folder ``out_dir`` (new); returns
    a summary. Written into a temporary folder of its own and renamed when complete
    (:func:`bridge_hpc.contracts.new_output.new_output_folder`). ``transformer_impl``: the layers the model
    is built of (Transformer Engine's need a GPU with the package); the weights are named alike in both,
    so the checkpoint loads into either."""
    import importlib.util

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from bridge_hpc.training.checkpoint import layout
    from bridge_hpc.training.checkpoint.megatron import (
        _dcp_writer,
        _save_model_and_optimizer,
        _uses_megatron_dist,
        _without_empty_extra_state,
    )
    from bridge_hpc.training.engine.model import gpt_model_provider
    from bridge_hpc.training.hf.load import load_hf_weights

    hf = families.read_config(hf_dir)
    cfg = mapping.checked_model_config(hf_dir)
    if transformer_impl != "local":
        if not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None:
            from bridge_hpc.contracts.errors import ConfigError

            raise ConfigError(f"needs a GPU with Transformer Engine; this machine has "
                              f"{'no CUDA' if not torch.cuda.is_available() else 'no transformer_engine package'}",
                              key="--transformer-impl")
        cfg = dataclasses.replace(cfg, transformer_impl=transformer_impl)
    progress(f"{hf['model_type']} model, {cfg.num_layers} layers, hidden {cfg.hidden_size}: building it")
    _world_of_one()
    model = gpt_model_provider(cfg)
    progress(f"reading its tensors from {hf_dir}")
    read = load_hf_weights(hf_dir, [model])
    with new_output_folder(out_dir) as tmp:
        folder = layout.iteration_dir(tmp, 0)
        os.makedirs(folder)
        progress(f"writing {layout.iteration_dir(out_dir, 0)}")
        if _uses_megatron_dist([model]):
            _save_model_and_optimizer([model], None, folder, save_optim=False, writers=4)
        else:
            dcp.save({"model": _without_empty_extra_state(get_model_state_dict(model))},
                     storage_writer=_dcp_writer(folder))
        layout._torch_save_durable({"rank": 0, "world_size": 1}, os.path.join(folder, "rank_00000.pt"))
        run_config = {"model": dataclasses.asdict(cfg), "checkpoint": {}}
        if any(os.path.isfile(os.path.join(hf_dir, name)) for name in families.TOKENIZER_FILES):
            run_config["tokenizer"] = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": os.path.abspath(hf_dir)}
        layout._write_durable(os.path.join(folder, layout.RUN_CONFIG_FILE), json.dumps(run_config, indent=2).encode())
        layout._torch_save_durable({"format_version": layout.FORMAT_VERSION, "iteration": 0, "train_state": {},
                                    "scheduler": None}, os.path.join(folder, layout.COMMON_FILE))
        from bridge_hpc.training.checkpoint.checkpointing import _write_manifest

        _write_manifest(folder, 0, 1)
        layout._write_tracker(tmp, 0)
    return {"family": hf["model_type"], "checkpoint": layout.iteration_dir(out_dir, 0), "bytes_read": read,
            "layers": cfg.transformer_impl,
            "format": "megatron-core dist_checkpointing" if _uses_megatron_dist([model]) else "torch DCP (CPU)"}
