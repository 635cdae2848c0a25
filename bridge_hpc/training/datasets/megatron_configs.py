"""The ``[dataset]`` configs as the ranks have them: megatron-core's ``GPTDatasetConfig`` (and so its
``BlendedMegatronDatasetConfig``) subclasses, as Megatron Bridge's are.

Each class here is the torch-free description of :mod:`bridge_hpc.training.datasets.config` (its fields,
Bridge's constructor, the login node's checks) *and* megatron-core's class: ``isinstance(cfg,
megatron.core.datasets.gpt_dataset.GPTDatasetConfig)`` holds, and ``finalize()`` runs megatron-core's
deferred ``__post_init__`` validation after the description's checks, as Bridge's ``finalize`` does.
The login node never imports this module (it imports torch and megatron-core): ``bridge-submit``
checks the description; :func:`bridge_hpc.training.config.runtime_config_update` turns the job file's
description into these classes on the ranks (:func:`for_ranks`), and ``bridge_hpc.training.config``'s
names ``GPTDatasetConfig``, ``GPTFIMDatasetConfig`` and ``MockGPTDatasetConfig`` are these classes
(resolved on first use, so importing that module stays torch-free).
"""

from __future__ import annotations

from typing import Any

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig as MCoreGPTDatasetConfig

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.training.datasets import config as described

__all__ = ["GPTDatasetConfig", "GPTFIMDatasetConfig", "MockGPTDatasetConfig", "for_ranks"]


def _megatron_core_checks(config: Any) -> None:
    """megatron-core's own validation of a blended dataset config (``BlendedMegatronDatasetConfig.
    __post_init__``: blends against splits, the index-cache options, ``split_matrix`` and ``mock``), which
    Bridge's deferred ``finalize`` runs; its assertion is a ConfigError naming the section, in its words."""
    try:
        BlendedMegatronDatasetConfig.__post_init__(config)
    except AssertionError as err:
        raise ConfigError(f"megatron-core: {err}", key="dataset") from None


class GPTDatasetConfig(described.GPTDatasetConfig, MCoreGPTDatasetConfig):
    """Megatron Bridge's ``GPTDatasetConfig``: :class:`bridge_hpc.training.datasets.config.GPTDatasetConfig`
    (fields, constructor, checks) that is also megatron-core's ``GPTDatasetConfig``."""

    def finalize(self) -> None:
        described.GPTDatasetConfig.finalize(self)
        _megatron_core_checks(self)


class GPTFIMDatasetConfig(described.GPTFIMDatasetConfig, GPTDatasetConfig):
    """Megatron Bridge's ``GPTFIMDatasetConfig``, a megatron-core ``GPTDatasetConfig``
    :class:`bridge_hpc.training.datasets.config.GPTFIMDatasetConfig`)."""

    def finalize(self) -> None:
        described.GPTFIMDatasetConfig.finalize(self)
        _megatron_core_checks(self)


class MockGPTDatasetConfig(described.MockGPTDatasetConfig, GPTDatasetConfig):
    """Megatron Bridge's ``MockGPTDatasetConfig``, a megatron-core ``GPTDatasetConfig`` in mock mode (see the
    description's :class:`bridge_hpc.training.datasets.config.MockGPTDatasetConfig`)."""

    def finalize(self) -> None:
        described.MockGPTDatasetConfig.finalize(self)
        _megatron_core_checks(self)


#: Each description type -> its class on the ranks.
_ON_RANKS = {described.GPTDatasetConfig: GPTDatasetConfig, described.GPTFIMDatasetConfig: GPTFIMDatasetConfig,
             described.MockGPTDatasetConfig: MockGPTDatasetConfig}


def for_ranks(dataset: Any) -> Any:
    """``dataset`` as the ranks have it: a description (exactly one of the torch-free GPT dataset types, as
    the job file's loader builds them) becomes the megatron-core subclass of the same name holding the
    same values; anything else (already one of these, fine-tuning data, a user's DatasetProvider) is
    returned as it is."""
    cls = _ON_RANKS.get(type(dataset))
    if cls is None:
        return dataset
    out = cls.__new__(cls)
    out.__dict__.update(dataset.__dict__)
    return out
