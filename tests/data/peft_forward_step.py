"""A forward step for the PEFT tests (``[job] forward_step = "tests/data/peft_forward_step.py:forward_step"``):
Bridge's GPT step, which also records what the frozen base weights are, as the ranks hold them.

At the first step of each process and at the run's last step, rank 0 writes the sha256 of every frozen
parameter (named as in the plain model) to ``<checkpoint.save>/../base_digests/<pid>_<step>.json``, so a test
can compare them with the pretrained checkpoint's: the base must not change, whatever the run did.
``TEST_STEP_SLEEP`` seconds of sleep before each forward pass give a signal time to land mid-run.
"""

import hashlib
import json
import os
import time

import torch

from bridge_hpc.training.engine.model import forward_step as gpt_forward_step

_seen = set()


def _digests(model) -> dict:
    out = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            plain = name.removeprefix("module.").replace(".to_wrap.", ".")
            out[plain] = hashlib.sha256(param.detach().float().contiguous().numpy().tobytes()).hexdigest()
    return out


def forward_step(state, data_iterator, model):
    step = state.train_state.step
    last = step + 1 == state.cfg.train.train_iters
    if torch.distributed.get_rank() == 0 and model.training and ("first" not in _seen or last) and step not in _seen:
        _seen.update({"first", step})
        folder = os.path.join(os.path.dirname(state.cfg.checkpoint.save), "base_digests")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{os.getpid()}_{step}.json"), "w") as f:
            json.dump(_digests(model), f)
    time.sleep(float(os.environ.get("TEST_STEP_SLEEP", "0") or 0))
    return gpt_forward_step(state, data_iterator, model)
