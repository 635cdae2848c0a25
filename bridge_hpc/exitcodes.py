"""Exit statuses that carry meaning between the ranks and the batch script.

The ranks cannot be trusted to requeue the job themselves (``scontrol`` may be missing on compute
nodes or inside a container), so they say what they want through their exit status and the batch
script, outside any container, acts on it.
"""

# The ranks saved a checkpoint and stopped with work left (signal, time limit): requeue the job.
EXIT_REQUEUE = 75  # EX_TEMPFAIL
