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
