"""Helpers for the training loop (forward-step adaptation, loss reduction, logging)."""
