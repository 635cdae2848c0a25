"""Models from elsewhere: :mod:`bridge_hpc.models.hf` converts Hugging Face checkpoints to this
toolkit's megatron-core GPT and back (``bridge-hf``). A floor above the training package: it builds
the toolkit's model and reads the Hugging Face folder with the training package's own pieces."""
