"""The ``[checkpoint]`` section: Megatron Bridge's CheckpointConfig (megatron's fields and Bridge's), torch-free,
re-exported by :mod:`bridge_hpc.training.config` (Bridge's path for it). Beside the code that saves and loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from bridge_hpc.contracts.schema import check as _check
from bridge_hpc.contracts.schema import check_left_at_default


@dataclass
class CheckpointConfig:
    """Saving and loading. ``load`` falls back to ``save`` in :meth:`finalize` so that a requeued
    job resumes from its own checkpoints without any extra setting.

    ``most_recent_k = -1`` keeps every checkpoint; ``save_interval = None`` saves only on exit;
    ``save_interval = "auto"`` has each run choose its interval for goodput, within
    ``save_interval_min`` / ``save_interval_max`` (bridge_hpc's keys; the rule and its inputs:
    :mod:`bridge_hpc.contracts.save_interval`, docs/preemption.md).

    ``async_save`` writes the interval saves in the background (a persistent worker process per
    rank; see ``bridge_hpc.training.checkpoint.async_writer``); exit saves stay synchronous. A failed
    background save is reported and training goes on; ``async_save_max_failures`` failures in a row
    (bridge_hpc's key) stop the run with an error.
    """

    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[Union[int, Literal["auto"]]] = None
    save_interval_min: Optional[int] = None
    save_interval_max: Optional[int] = None
    most_recent_k: int = -1
    async_save: bool = False
    async_save_max_failures: int = 3
    pretrained_checkpoint: Optional[str] = None
    ckpt_format: Literal["torch_dist"] = "torch_dist"
    save_optim: bool = True
    save_rng: bool = True
    load_optim: bool = True
    load_rng: bool = True
    finetune: bool = False
    exit_on_missing_checkpoint: bool = False
    #: torch_dist files each rank writes, in parallel (Bridge's name; Bridge's default is 1: here 4, which
    #: wrote the H100 figures in the README's performance section).
    storage_writers_per_rank: int = 4
    #: Megatron-LM's ``--dist-ckpt-optim-fully-reshardable``: the distributed optimizer's state is
    #: saved in megatron-core's ``fully_reshardable`` layout, which loads at any tensor/pipeline/data-
    #: parallel layout (each data-parallel group gathers its state to one rank while saving). Off
    #: (Megatron's default, ``dp_reshardable``): each rank writes its own shard, fast, and the state
    #: loads at another data-parallel size only; a model-parallel change then needs this on when
    #: saving, or ``load_optim = false``. Weights load at any layout either way.
    dist_ckpt_optim_fully_reshardable: bool = False
    #: Bridge's async-save options, with the only values this trainer has: one persistent worker
    #: process (a worker per save would pay its start-up in every save), nvidia-resiliency-ext's
    #: strategy, write results collected in the worker itself (no multiprocessing queue, so "fork"
    #: describes it), no FSDP DTensor checkpoints and no custom checkpoint manager.
    use_persistent_ckpt_worker: bool = True
    async_strategy: Literal["nvrx"] = "nvrx"
    async_write_results_mp_mode: Literal["fork"] = "fork"
    strict_fsdp_dtensor_load: bool = False
    custom_manager_class: Optional[str] = None
    # Megatron's remaining checkpoint options (megatron.training's CheckpointConfig), with its defaults.
    # Their defaults describe what this trainer does; other values are refused by name in finalize,
    # each with the reason, rather than ignored.
    save_params_interval: Optional[int] = None
    save_activations_interval: Optional[int] = None
    save_tokens_per_expert_interval: Optional[int] = None
    save_wgrads_interval: Optional[int] = None
    save_dgrads_interval: Optional[int] = None
    save_retain_interval: Optional[int] = None
    load_main_params_from_ckpt: bool = False
    non_persistent_save_interval: Optional[int] = None
    non_persistent_ckpt_type: Optional[Literal["global", "local", "in_memory"]] = None
    non_persistent_global_ckpt_dir: Optional[str] = None
    non_persistent_local_ckpt_dir: Optional[str] = None
    non_persistent_local_ckpt_algo: Literal["fully_parallel", "atomic"] = "fully_parallel"
    ckpt_step: Optional[int] = None
    use_checkpoint_args: bool = False
    use_mp_args_from_checkpoint_args: bool = False
    use_tokenizer_model_from_checkpoint_args: bool = True
    auto_detect_ckpt_format: bool = False
    ckpt_convert_format: Optional[Literal["torch", "torch_dist"]] = None
    ckpt_convert_save: Optional[str] = None
    ckpt_convert_update_legacy_dist_opt_format: bool = False
    fully_parallel_save: bool = True
    async_ckpt_cpu_priority: int = 10
    async_ckpt_io_priority: Optional[int] = 3
    async_ckpt_use_cpu_shm: bool = False
    fully_parallel_load: bool = False
    ckpt_fully_parallel_load_exchange_algo: Literal["broadcast", "gather_rounds", "gather_object"] = "broadcast"
    ckpt_fully_parallel_save_process_group: Literal["dp", "ep_dp"] = "dp"
    ckpt_fully_parallel_load_process_group: Literal["dp", "ep_dp"] = "dp"
    ckpt_fully_parallel_save_replicate_local: bool = False
    ckpt_fully_parallel_load_replicate_local: bool = False
    ckpt_assume_constant_structure: bool = False
    ckpt_load_validate_sharding_integrity: bool = True
    dist_ckpt_strictness: Literal["assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected",
                                  "raise_all", "return_unexpected", "return_all", "ignore_all"] = "assume_ok_unexpected"
    dist_ckpt_save_pre_mcore_014: bool = False
    distrib_optim_fully_reshardable_mem_efficient: bool = False
    save_tokenizer_assets: bool = True
    replication: bool = False
    replication_jump: Optional[int] = None
    replication_factor: int = 2
    verify_integrity: bool = False
    #: Set by the job file's loader, not a key: ``[cluster] node_mtbf_hours`` and ``[slurm] nodes``, the
    #: prior of ``save_interval = "auto"``; and whether this config asked for ``"auto"`` (each run
    #: replaces ``save_interval`` by the interval it chose).
    node_mtbf_hours: Optional[float] = field(default=None, init=False, repr=False)
    nodes: int = field(default=1, init=False, repr=False)
    save_interval_auto: bool = field(default=False, init=False, repr=False)

    def finalize(self) -> None:
        # Megatron Bridge's rules, in its words after the key (before checkpoint.load defaults to save)
        _check(self.ckpt_step is None or self.load is not None, "checkpoint.ckpt_step",
               f"ckpt_step={self.ckpt_step} specified but checkpoint.load is None. "
               "Please set checkpoint.load to the base checkpoint directory.")
        _check(not (self.load_main_params_from_ckpt and self.load_optim), "checkpoint.load_main_params_from_ckpt",
               "load_main_params_from_ckpt must be used with load_optim=False")
        if self.load is None:
            self.load = self.save
        if self.save_interval == "auto":
            self.save_interval_auto = True
        _check(self.save_interval is None or self.save_interval == "auto" or self.save_interval > 0,
               "checkpoint.save_interval", "must be > 0, or \"auto\"")
        for key in ("save_interval_min", "save_interval_max"):
            value = getattr(self, key)
            _check(value is None or value > 0, f"checkpoint.{key}", f"must be > 0 steps, got {value}")
            _check(value is None or self.save_interval_auto, f"checkpoint.{key}",
                   f"bounds checkpoint.save_interval = \"auto\" only; it is {self.save_interval!r} here")
        _check(self.save_interval_min is None or self.save_interval_max is None
               or self.save_interval_min <= self.save_interval_max, "checkpoint.save_interval_max",
               f"must be >= checkpoint.save_interval_min ({self.save_interval_min}), got {self.save_interval_max}")
        _check(self.storage_writers_per_rank > 0, "checkpoint.storage_writers_per_rank", "must be > 0")
        _check(self.use_persistent_ckpt_worker, "checkpoint.use_persistent_ckpt_worker",
               "must be true: async saves go through one persistent worker process (a worker per save "
               "would pay its start-up in every save)")
        _check(self.async_strategy == "nvrx", "checkpoint.async_strategy",
               "must be \"nvrx\": async saves use nvidia-resiliency-ext's queue and worker")
        _check(self.async_write_results_mp_mode == "fork", "checkpoint.async_write_results_mp_mode",
               "must be \"fork\": write results are collected in the worker process, not through a queue")
        _check(not self.strict_fsdp_dtensor_load, "checkpoint.strict_fsdp_dtensor_load",
               "must be false: there are no FSDP DTensor checkpoints here")
        _check(self.custom_manager_class is None, "checkpoint.custom_manager_class",
               "must be unset: bridge_hpc's checkpointing (atomic folders, manifest, async worker) has no "
               "pluggable manager")
        _check(self.most_recent_k == -1 or self.most_recent_k > 0,
               "checkpoint.most_recent_k", "must be -1 (keep all) or > 0")
        _check(self.async_save_max_failures >= 1, "checkpoint.async_save_max_failures",
               "must be >= 1 (failed background saves in a row before the run stops)")
        dumps = "bridge_hpc does not write Megatron's per-tensor debug dumps"
        non_persistent = ("bridge_hpc's checkpoints are all persistent (async interval saves are its cheap "
                          "ones); use checkpoint.save_interval with checkpoint.async_save = true")
        layout = "bridge_hpc's checkpoint layout and load path are fixed (atomic iteration folders with a manifest)"
        check_left_at_default(self, "checkpoint", {
            **{name: dumps for name in ("save_params_interval", "save_activations_interval",
                                        "save_tokens_per_expert_interval", "save_wgrads_interval",
                                        "save_dgrads_interval")},
            **{name: non_persistent for name in ("non_persistent_save_interval", "non_persistent_ckpt_type",
                                                 "non_persistent_global_ckpt_dir", "non_persistent_local_ckpt_dir",
                                                 "non_persistent_local_ckpt_algo", "replication",
                                                 "replication_jump", "replication_factor")},
            "load_main_params_from_ckpt": "a checkpoint loaded without its optimizer state gives the optimizer's "
                                          "main parameters from the loaded weights already",
            "use_checkpoint_args": "the job file is the configuration; a checkpoint's saved config is checked "
                                   "against it, never applied",
            "use_mp_args_from_checkpoint_args": "the job file sets the parallel layout; checkpoints reshard to it",
            "use_tokenizer_model_from_checkpoint_args": "the job file's [tokenizer] is what runs",
            "auto_detect_ckpt_format": "checkpoints are torch_dist only (checkpoint.ckpt_format)",
            "ckpt_convert_format": "there is no format conversion on load (bridge-hf converts Hugging Face models)",
            "ckpt_convert_save": "there is no format conversion on load",
            "ckpt_convert_update_legacy_dist_opt_format": "legacy (pre-2024) distributed-optimizer checkpoints "
                                                          "are not read",
            "fully_parallel_save": layout,
            "fully_parallel_load": layout + "; loads with several data-parallel ranks are already fully parallel",
            "ckpt_fully_parallel_load_exchange_algo": layout,
            "ckpt_fully_parallel_save_process_group": layout,
            "ckpt_fully_parallel_load_process_group": layout,
            "ckpt_fully_parallel_save_replicate_local": layout,
            "ckpt_fully_parallel_load_replicate_local": layout,
            "ckpt_assume_constant_structure": "the async writer already caches the save plan, checking the "
                                              "structure each time (safe, and as fast)",
            "ckpt_load_validate_sharding_integrity": layout,
            "dist_ckpt_strictness": "a key the model lacks, or a missing key, always stops the load (the "
                                    "checkpoint is the wrong one)",
            "dist_ckpt_save_pre_mcore_014": layout,
            "distrib_optim_fully_reshardable_mem_efficient": layout,
            "save_tokenizer_assets": layout + "; the tokenizer is named by the job file",
            "async_ckpt_cpu_priority": "the async writer's priority is set by bridge_hpc",
            "async_ckpt_io_priority": "the async writer's priority is set by bridge_hpc",
            "async_ckpt_use_cpu_shm": "the async writer stages tensors in its own pinned buffers",
            "verify_integrity": "every checkpoint is verified against its manifest (sizes) on load already",
        })
        _check(not self.async_save or self.save is not None, "checkpoint.async_save",
               "needs checkpoint.save (the folder the background saves write)")
        _check(self.save_retain_interval is None or self.save_retain_interval > 0, "checkpoint.save_retain_interval",
               "must be > 0 (or unset)")
        _check(self.save_retain_interval is None or self.save_interval is not None, "checkpoint.save_retain_interval",
               "needs checkpoint.save_interval (the saves it keeps some of)")
        _check(self.ckpt_step is None or self.ckpt_step >= 0, "checkpoint.ckpt_step", "must be >= 0 (an iteration)")
