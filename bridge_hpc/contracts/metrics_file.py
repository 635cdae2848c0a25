"""``metrics.jsonl``: one JSON object per finished training step, written by rank 0, read by reports.

The field names are defined here once: the ranks write them (``training.utils.train_utils.training_log``
through ``training.engine.metrics``), ``bridge-report`` and ``bridge-status --follow`` read them
(``report.curves``, ``report.live``). Stdlib only. Fields a record may hold besides these (other
entries of the loss dict, the periodic reports of ``logger.log_interval``) keep the names they have.
"""

#: The step the record is of (int, from 1): the key every reader orders and deduplicates by.
STEP = "step"
#: The training loss of the step (the loss dict's ``lm loss``, else its first entry).
LOSS = "loss"
#: The learning rate the step used.
LR = "lr"
#: The gradient norm before clipping (None where the optimizer did not compute it).
GRAD_NORM = "grad_norm"
#: Tokens of the global batch over the step's wall time.
TOKENS_PER_S = "tokens_per_s"
#: The step's wall time, in seconds.
STEP_TIME_S = "step_time_s"
#: Samples consumed after the step (the data position a checkpoint records).
CONSUMED_SAMPLES = "consumed_samples"
#: 1 when the optimizer skipped the step (an inf or nan gradient), else 0.
SKIPPED = "skipped"
#: An evaluation at this step joins its record under this key (the validation loss).
VALIDATION_LOSS = "val_loss"
#: Mixture-of-Experts: the auxiliary losses of the step, each averaged over the MoE layers, under
#: megatron-core's tracker names (the coefficients not applied: 1.0 is balanced load).
MOE_LOSSES = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss", "z_loss")
