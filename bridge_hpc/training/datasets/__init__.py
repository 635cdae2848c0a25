"""Datasets and the iterators the loop reads from: builders for the dataset configs, fill-in-the-middle."""
