"""``bridge.training.tokenizers.config`` (Megatron Bridge's module path): the ``[tokenizer]`` section's
dataclass. It is defined once, with the other sections, in :mod:`bridge_hpc.training.config`."""

from bridge_hpc.training.config import TokenizerConfig

__all__ = ["TokenizerConfig"]
