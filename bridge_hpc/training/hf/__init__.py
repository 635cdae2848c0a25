"""Hugging Face checkpoints read (Megatron Bridge's AutoBridge, for the GPT families here): what the
job file's loader checks on the login node and what each rank reads of a folder.

- :mod:`.families` (torch-free, login node): ``config.json`` -> the ``[model]`` section and back, per
  family (Llama, Mistral, Qwen2, Qwen3, GPT-2);
- :mod:`.safetensors_files` (torch-free, login node): the folder's shards, index and tensor headers,
  read with the standard library, checked before anything is submitted;
- :mod:`.param_mapping` (torch-free at module level): Megatron Bridge's param mappings, one class per
  kind, each holding both directions (fused QKV by query group, gated fc1, transposed GPT-2 Conv1D,
  padded vocabulary, MoE experts); :mod:`.mapping_registry`: a model's mappings, looked up by name;
- :mod:`.mapping` (torch-free): each family's mappings as a registry, and the login node's check of a
  folder's tensor headers against it;
- :mod:`.load` (ranks): each rank reads only its slices of the tensors of its layers.

The tools that write checkpoints in and out (``bridge-hf``) sit a floor above, in
:mod:`bridge_hpc.models.hf`.
"""
