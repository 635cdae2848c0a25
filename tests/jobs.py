"""The smallest training sections a job config can have: the login node validates them too."""

MINIMAL_TRAINING = {
    "train": {"train_iters": 1, "micro_batch_size": 1, "global_batch_size": 1},
    "optimizer": {"lr": 1e-3},
}
MINIMAL_TRAINING_TOML = """
[train]
train_iters = 1
micro_batch_size = 1
global_batch_size = 1

[optimizer]
lr = 1e-3
"""


def model_params(checkpoint_dir: str, scratch: str) -> dict:
    """The model tensors of a DCP checkpoint folder, read without a process group."""
    import os
    import random

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = os.path.join(scratch, f"{os.path.basename(checkpoint_dir)}_{random.random()}.pt")
    dcp_to_torch_save(checkpoint_dir, out)
    state = torch.load(out, weights_only=False)
    return dict(state["model"])


def assert_bitwise_equal(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys() and a
    for key in a:
        assert torch.equal(a[key], b[key]), key
