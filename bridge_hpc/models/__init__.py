"""Models from elsewhere: :mod:`bridge_hpc.models.hf` converts Hugging Face checkpoints to this
toolkit's megatron-core GPT and back."""
