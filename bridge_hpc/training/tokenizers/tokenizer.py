"""``bridge.training.tokenizers.tokenizer`` (Megatron Bridge's module path): the tokenizer type that
``ConfigContainer.tokenizer`` and the datasets hold. The toolkit's tokenizers are megatron-core's own
(``megatron.core.tokenizers``), built by :func:`bridge_hpc.training.tokenizers.build_tokenizer`."""

from megatron.core.tokenizers import MegatronTokenizer

from bridge_hpc.training.tokenizers import build_tokenizer

__all__ = ["MegatronTokenizer", "build_tokenizer"]
