"""``bridge.training.tokenizers.tokenizer`` (Megatron Bridge's module path). ``MegatronTokenizer`` is
megatron-core's tokenizer entry class (``megatron.core.tokenizers.MegatronTokenizer``), which Bridge's
module re-exports too and names as the type of ``DatasetBuildContext.tokenizer``; the tokenizers
themselves are megatron-core's text tokenizers, built by
:func:`bridge_hpc.training.tokenizers.build_tokenizer` from a ``TokenizerConfig``.

``MegatronTokenizer`` is resolved on first use (a module ``__getattr__``), not at import: this package
is imported on the login node and by ``bridge-prepare-data``, which must not pay for torch and
megatron-core until a tokenizer is really built."""

from typing import TYPE_CHECKING, Any

from bridge_hpc.training.tokenizers import build_tokenizer

if TYPE_CHECKING:
    from megatron.core.tokenizers import MegatronTokenizer

__all__ = ["MegatronTokenizer", "build_tokenizer"]


def __getattr__(name: str) -> Any:
    if name == "MegatronTokenizer":
        from megatron.core.tokenizers import MegatronTokenizer

        return MegatronTokenizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
