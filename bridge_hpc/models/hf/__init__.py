"""Hugging Face checkpoints in and out (Megatron Bridge's AutoBridge, for the GPT families here).

- :mod:`.families` (torch-free, login node): ``config.json`` -> the ``[model]`` section and back, per
  family (Llama, Mistral, Qwen2, Qwen3, GPT-2);
- :mod:`.safetensors_files` (torch-free, login node): the folder's shards, index and tensor headers,
  read with the standard library, checked before anything is submitted;
- :mod:`.mapping` (torch-free): which Hugging Face tensors make each megatron-core parameter, and how
  (fused QKV by query group, gated fc1, transposed GPT-2 Conv1D, padded vocabulary);
- :mod:`.load` (ranks): each rank reads only its slices of the tensors of its layers;
- :mod:`.export` and :mod:`.convert` (``bridge-hf``): a toolkit checkpoint at any layout -> a
  Hugging Face folder, and a Hugging Face folder -> a toolkit checkpoint.
"""
