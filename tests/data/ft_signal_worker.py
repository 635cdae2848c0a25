"""A rank for the Slurm test of tests/test_fault_tolerance.py: waits for SIGUSR1 (as a rank waits for
Slurm's warning before the time limit), records it, and exits 0. Writes <out>/signal_rank<r>.txt."""

import os
import signal
import sys
import time

out, rank = sys.argv[1], int(os.environ["RANK"])
got = []
signal.signal(signal.SIGUSR1, lambda s, f: got.append(time.time()))
with open(os.path.join(out, f"ready_rank{rank}"), "w") as f:
    f.write(str(os.getpid()))
t0 = time.time()
while not got and time.time() - t0 < 45:
    time.sleep(0.05)
with open(os.path.join(out, f"signal_rank{rank}.txt"), "w") as f:
    f.write(f"{os.environ.get('TORCHELASTIC_RESTART_COUNT')} {got[0] if got else 'none'}\n")
