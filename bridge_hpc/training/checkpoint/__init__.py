"""Checkpoints on the ranks: on-disk layout, save, load, the async writer and its worker, read-ahead."""
