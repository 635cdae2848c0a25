"""Surviving faults on the ranks: fault tolerance, straggler detection, in-process restart, the rerun
state machine, and the exit policy (checkpoint-and-exit on a signal, time limit or duration)."""
