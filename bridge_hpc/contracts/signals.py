"""The stop signal: ``[slurm] signal`` parsed once, for every process that must agree on it.

Slurm warns a job before its time limit with ``#SBATCH --signal=[{R|B}:]SIG[@seconds]``, and stops it
(preemption, time limit, ``scancel``) with SIGTERM. The consumers of that choice:

- the sbatch header (``--signal``) and the batch shell's traps (the template);
- every rank's handler (``train.exit_signal``, filled from here at submission);
- nvidia-resiliency-ext's ``ft_launcher``, which must survive the warning signal
  (``bridge_hpc.launch.ft_launch``);
- the DataLoader workers, which leave the stop signals to their rank (``training.datasets.builders``).

All of them take their list from :class:`StopSignal` (``rank_signals``). The ranks handle exactly the
configured signal plus SIGTERM. The ``B:`` form makes Slurm signal only the batch shell, which by
itself would reach no rank; the batch shell forwards it to the job's steps (``scancel --signal``), so
the ranks see the same signal as without ``B:``. Stdlib only.
"""

from __future__ import annotations

import contextlib
import re
import signal
from dataclasses import dataclass
from typing import Optional, Tuple

#: ``[slurm] signal`` when the job does not set it.
DEFAULT_SLURM_SIGNAL = "USR1@120"
#: Slurm's own stop (preemption, time limit, scancel): always handled by the ranks.
TERMINATE = "TERM"
#: Signals a job may choose: each one has a handler on the ranks and is tested end to end. KILL and
#: STOP cannot be handled, CONT is Slurm's own resume signal, and the rest have other meanings.
ALLOWED = ("USR1", "USR2", "TERM", "INT", "HUP")
#: The signals nvidia-resiliency-ext's ft_launcher handles itself (it forwards them to the ranks): the
#: fault-tolerance launcher wrapper must leave them to it rather than ignore them.
FT_LAUNCHER_FORWARDS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")

_FORM = re.compile(r"(?:(?P<flags>[RB]{1,2}):)?(?P<sig>[A-Z0-9]+)(?:@(?P<secs>[0-9]{1,7}))?")


@dataclass(frozen=True)
class StopSignal:
    """A parsed ``[slurm] signal``: ``name`` without ``SIG`` (``USR1``), ``seconds`` before the end."""

    name: str
    seconds: Optional[int] = None
    batch_only: bool = False  # "B:": Slurm signals only the batch shell, which forwards it
    reservation: bool = False  # "R:": may overlap a reservation's MaxStartDelay (Slurm's meaning)

    @property
    def sbatch_value(self) -> str:
        """The ``#SBATCH --signal=`` value."""
        flags = ("R" if self.reservation else "") + ("B" if self.batch_only else "")
        prefix = f"{flags}:" if flags else ""
        return f"{prefix}{self.name}" + (f"@{self.seconds}" if self.seconds is not None else "")

    @property
    def trap_names(self) -> Tuple[str, ...]:
        """The signals the batch shell traps (bash names, without ``SIG``)."""
        return tuple(dict.fromkeys((self.name, TERMINATE)))

    @property
    def rank_signals(self) -> Tuple[str, ...]:
        """What every rank handles (Python names): the configured signal plus SIGTERM."""
        return tuple(f"SIG{name}" for name in self.trap_names)

    @property
    def warning_signals(self) -> Tuple[str, ...]:
        """Stop signals other than SIGTERM: processes that only pass the stop on to the ranks (the
        FT launcher, loader workers) ignore these rather than die of their default action."""
        return tuple(s for s in self.rank_signals if s != f"SIG{TERMINATE}")


def parse_slurm_signal(text: str) -> StopSignal:
    """``"USR1@120"``, ``"B:USR2@60"``, ``"R:TERM@90"``, ``"SIGUSR1"``, ``"10@60"`` -> StopSignal.

    Raises ValueError with a message saying what is accepted."""
    expected = (f"expected [R:|B:]SIGNAL[@seconds] with SIGNAL one of {', '.join(ALLOWED)} "
                f"(e.g. {DEFAULT_SLURM_SIGNAL})")
    match = _FORM.fullmatch(text.upper()) if isinstance(text, str) else None  # Slurm ignores case
    if match is None:
        raise ValueError(f"{expected}, got {text!r}")
    flags = match["flags"] or ""
    if len(set(flags)) != len(flags):
        raise ValueError(f"{expected}, got {text!r}")
    name = match["sig"]
    if name.isdigit():
        try:
            name = signal.Signals(int(name)).name
        except ValueError:
            raise ValueError(f"{expected}; {match['sig']} is not a signal number") from None
    name = name[3:] if name.startswith("SIG") else name
    if name not in ALLOWED:
        raise ValueError(f"{expected}; {match['sig']} cannot stop a job here" if name in _KNOWN else f"{expected}, got {text!r}")
    return StopSignal(name=name, seconds=int(match["secs"]) if match["secs"] is not None else None,
                      batch_only="B" in flags, reservation="R" in flags)


_KNOWN = {s.name[3:] for s in signal.Signals if s.name.startswith("SIG") and not s.name.startswith("SIG_")}


def default_rank_signals() -> Tuple[str, ...]:
    """The ranks' stop signals for a config that has no ``[slurm]`` say (``pretrain`` called directly)."""
    return parse_slurm_signal(DEFAULT_SLURM_SIGNAL).rank_signals


def ignore(names) -> None:
    """Set the named signals (``"SIGUSR1"``) to SIG_IGN in this process, then unblock them: one that
    arrived while they were blocked (see :func:`blocked`) is discarded, not delivered."""
    numbers = [getattr(signal, name) for name in names]
    for number in numbers:
        signal.signal(number, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, numbers)


@contextlib.contextmanager
def blocked(names):
    """The named signals blocked in this thread for the ``with`` body, then delivered if they came.

    Around forking data-loader workers: a child inherits the mask, so a stop signal that reaches it
    before it has set the signal to SIG_IGN (its :func:`ignore`) waits instead of killing it."""
    numbers = [getattr(signal, name) for name in names]
    signal.pthread_sigmask(signal.SIG_BLOCK, numbers)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, numbers)
