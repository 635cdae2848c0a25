"""Parameter-efficient fine-tuning at Megatron Bridge's paths: ``bridge_hpc.peft.lora.LoRA``,
``bridge_hpc.peft.dora.DoRA`` and their base ``bridge_hpc.peft.base.PEFT`` (``megatron.bridge.peft.*``).

The config classes (``base``, ``lora``, ``dora``, ``module_matcher``, ``utils``, ``config``,
``checkpoint``) import no torch, so the login node checks a job's ``[peft]`` section in
milliseconds; the adapters (``lora_layers``, ``dora_layers``) and the merge (``merge``) are
imported by the ranks when a model is transformed. See docs/peft.md.
"""
