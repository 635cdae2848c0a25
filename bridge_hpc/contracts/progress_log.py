"""The progress log (``progress.txt``): a writer for rank 0 and a parser for ``bridge-report``.

The format is Megatron-LM's (described in ``shared/notes/progress-log.md``)::

    <YYYY-MM-DD HH:MM:SS>\\tJob ID: <id>\\t# GPUs: <world>\\t<event>[\\t<Key>: <value>]...

Users already have tools that parse it, some by position (Megatron itself reads the FLOPs of a
``Saved checkpoint`` line as the 8th tab-separated token), so bridge_hpc keeps the standard events and
fields exactly where Megatron puts them and only *appends*: extra fields go after the standard ones,
extra events (``Loaded checkpoint``, ``First step``, ``Ending job``, ``Restart``, ``Checkpoint
fallback``, ``Checkpoint save failed``, ``Result validation``, ``Save interval``) use the same
``Key: value`` style.  These extra events are what make goodput computable: why a run ended, and the
time spent on start-up, checkpoint load and save and on steps that were lost.

Stdlib only: the ranks import the writer, the login node imports the parser.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

TIME_FORMAT = "%Y-%m-%d %H:%M:%S"

STARTING_JOB = "Starting job"
SAVED_CHECKPOINT = "Saved checkpoint"
SAVING_ASYNC = "Saving async checkpoint"
LOADED_CHECKPOINT = "Loaded checkpoint"
FIRST_STEP = "First step"
#: The ``First step`` field listing where the start-up went (bridge_hpc.training.process.startup).
STARTUP_PHASES = "Start-up phases"
ENDING_JOB = "Ending job"
RESTART = "Restart"
CHECKPOINT_FALLBACK = "Checkpoint fallback"
#: A background (asynchronous) checkpoint save that failed; the tracker still names the previous one.
CHECKPOINT_SAVE_FAILED = "Checkpoint save failed"
#: A loss that failed result validation and the re-run of its step (``[rerun_state_machine]``): which
#: check, on how many ranks, whether the re-run reproduced it, and whether training went on.
RESULT_VALIDATION = "Result validation"
#: The interval a run chose with ``[checkpoint] save_interval = "auto"``, and its inputs (the fields are
#: :mod:`bridge_hpc.contracts.save_interval`'s).
SAVE_INTERVAL = "Save interval"

SAVE_EVENTS = (SAVED_CHECKPOINT, SAVING_ASYNC)

#: Field names that readers look up (the report, the benchmarks); the writer below spells them
#: through these too. The ``First step`` line's :data:`STARTUP_PHASES` and ``Starting job``'s :data:`DEVICE`
#: are defined next to their events.
ITERATION = "Iteration"
SAVE_SECONDS = "Save seconds"
LOAD_SECONDS = "Load seconds"
STEPS_LOST = "Steps lost"
REASON = "Reason"
STARTUP_SECONDS = "Start-up seconds"
SECONDS_SINCE_PROCESS_START = "Seconds since process start"
LOST_SECONDS = "Lost seconds"
CAUSE = "Cause"
JOB_THROUGHPUT = "Job throughput"
CUMULATIVE_THROUGHPUT = "Cumulative throughput"
FLOATING_POINT_OPERATIONS = "Floating-point operations"
RESTART_COUNT = "Restart count"

#: A ``Starting job`` field: what the ranks compute on, ``torch.cuda.get_device_name()`` (e.g. "NVIDIA
#: H100 80GB HBM3") or "cpu". Megatron's "# GPUs" counts ranks whatever they run on; this says on what.
DEVICE = "Device"

#: Why a run ended. The last four come from result validation (:mod:`bridge_hpc.training.resilience.rerun`): a
#: NaN / Inf loss (or another fatal check) that its step's re-run reproduced, which stops the job for
#: good; and ``transient_fault``, a fatal result the re-run did not reproduce (suspect hardware), after
#: which the job is requeued to redo the step.
END_REASONS = ("signal", "time_limit", "duration", "interval", "done", "error", "fault", "straggler", "cancelled",
               "nan_loss", "inf_loss", "invalid_result", "transient_fault")


def format_time(epoch: float) -> str:
    """Local time, second resolution, as Megatron writes it (its readers compare with ``now()``)."""
    return time.strftime(TIME_FORMAT, time.localtime(epoch))


def parse_time(text: str) -> float:
    """Inverse of :func:`format_time`; raises ValueError on a malformed stamp."""
    return time.mktime(time.strptime(text, TIME_FORMAT))


# --------------------------------------------------------------------------------------------------
# Parser


@dataclass
class Event:
    """One line of the log. ``fields`` keeps the raw text values, in file order."""

    time: float
    job_id: str
    world_size: int
    name: str
    fields: Dict[str, str] = field(default_factory=dict)
    line: int = field(default=0, compare=False)  # 1-based line number in its file (0: not read from a file)

    def number(self, key: str) -> Optional[float]:
        """The leading number of a field (``"95.2 TFLOP/s/GPU"`` -> 95.2); None if absent or not numeric."""
        text = self.fields.get(key)
        if text is None:
            return None
        try:
            return float(text.split()[0])
        except (ValueError, IndexError):
            return None


@dataclass
class Run:
    """One ``Starting job`` line and every line after it up to the next ``Starting job``.

    A Slurm requeue and an in-job restart by fault tolerance both start a new run; the ``Restart``
    line that precedes an in-job restart belongs to the run it ends.
    """

    job_id: str
    world_size: int
    start: Event
    events: List[Event] = field(default_factory=list)  # after the Starting job line

    @property
    def restart_count(self) -> Optional[int]:
        value = self.start.number(RESTART_COUNT)
        return None if value is None else int(value)

    @property
    def device(self) -> Optional[str]:
        """The :data:`DEVICE` of the ``Starting job`` line; None where the log does not say."""
        return self.start.fields.get(DEVICE) or None

    def of(self, *names: str) -> List[Event]:
        return [e for e in self.events if e.name in names]

    def last(self, name: str) -> Optional[Event]:
        found = self.of(name)
        return found[-1] if found else None


def parse_line(line: str) -> Optional[Event]:
    """Parse one line; None for anything that is not a well-formed progress line (never raises)."""
    tokens = line.rstrip("\r\n").split("\t")
    if len(tokens) < 4:
        return None
    try:
        stamp = parse_time(tokens[0])
        job_key, job_id = tokens[1].split(": ", 1)
        gpus_key, gpus = tokens[2].split(": ", 1)
        world_size = int(gpus)
    except ValueError:
        return None
    if job_key != "Job ID" or gpus_key != "# GPUs":
        return None
    fields = {}
    for token in tokens[4:]:
        key, sep, value = token.partition(": ")
        if sep:  # a token that is not `Key: value` is ignored, not fatal
            fields[key] = value
    return Event(stamp, job_id, world_size, tokens[3], fields)


@dataclass
class ProgressRead:
    """What :func:`read_progress` made of a log: the runs, and the numbers of the lines it passed over."""

    runs: List[Run]
    skipped: List[int] = field(default_factory=list)  # 1-based line numbers, in file order
    lines: int = 0  # non-blank lines in the file


def read_events(path: str) -> Tuple[List[Event], List[int], int]:
    """(the well-formed lines of ``path`` as events, the numbers of the non-blank lines that are not,
    the number of non-blank lines). Raises OSError when the file cannot be read.

    A line that is not valid UTF-8 is passed over whole (a byte flipped in ``Iteration: 1200`` could
    make any number), and so is one that is not a progress line. A last line without its newline was
    cut short by a kill (the writers end every line with one in the same write): passed over too, as
    a half-written ``Iteration: 12`` could really be 1234.
    """
    with open(path, "rb") as f:
        data = f.read()
    events: List[Event] = []
    skipped: List[int] = []
    lines = data.split(b"\n")
    count = 0
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        count += 1
        event = None
        if number < len(lines):  # the text after the last newline is b"" or a truncated line
            try:
                event = parse_line(raw.decode("utf-8"))
            except UnicodeDecodeError:
                event = None
        if event is None:
            skipped.append(number)
        else:
            event.line = number
            events.append(event)
    return events, skipped, count


def parse_events(path: str) -> List[Event]:
    """The well-formed lines of ``path`` (:func:`read_events` tells which lines it passed over)."""
    return read_events(path)[0]


#: The lines that end a run: any line after one, up to the next ``Starting job``, belongs to a run whose
#: ``Starting job`` line is missing, except the one ``Restart`` line that fault tolerance's next
#: attempt writes for the run that failed (after that run's own ``Ending job``, when it wrote one).
_ENDS = (ENDING_JOB, RESTART)


def split_runs(events: List[Event]) -> Tuple[List[Run], List[Event]]:
    """Split events into runs: (runs, events that belong to no run). An event belongs to no run when
    it comes before the first ``Starting job``, names another job than its run, or follows its run's
    ``Ending job`` or ``Restart``: a damaged or lost ``Starting job`` line must not make one run of two,
    which would count the time between them as the first's. A ``Restart`` line after its run's
    ``Ending job`` is that run's (:meth:`ProgressLog.restart` is written for the run that failed, by
    the attempt that follows it, before that attempt's ``Starting job``)."""
    runs: List[Run] = []
    orphans: List[Event] = []
    ended_by: Optional[str] = None  # the Ending job or Restart line that ended the last run
    for event in events:
        if event.name == STARTING_JOB:
            runs.append(Run(event.job_id, event.world_size, event))
            ended_by = None
        elif not runs or event.job_id != runs[-1].job_id or (
                ended_by is not None and not (event.name == RESTART and ended_by == ENDING_JOB)):
            orphans.append(event)
        else:
            runs[-1].events.append(event)
            if event.name in _ENDS:
                ended_by = event.name
    return runs, orphans


def group_runs(events: List[Event]) -> List[Run]:
    """Split events into runs (:func:`split_runs`, less the events that belong to no run)."""
    return split_runs(events)[0]


def read_progress(path: str) -> ProgressRead:
    """Read a progress log written by bridge_hpc, Megatron-LM or Megatron Bridge into runs, with the
    lines passed over: damaged ones (:func:`read_events`) and those that belong to no run
    (:func:`split_runs`). Raises OSError when the file cannot be read."""
    events, skipped, count = read_events(path)
    runs, orphans = split_runs(events)
    return ProgressRead(runs, sorted(skipped + [e.line for e in orphans]), count)


def parse_progress(path: str) -> List[Run]:
    """The runs of a progress log (:func:`read_progress` without the lines it passed over)."""
    return read_progress(path).runs


def cumulative_baseline(events: List[Event], world_size: int) -> Tuple[Optional[float], float]:
    """Megatron's ``get_start_time_from_progress_log``, for the events of an existing log.

    Returns (time of the first ``Starting job`` of ``world_size`` since the last line with another
    world size, or None; FLOPs of the last ``Saved checkpoint`` before that line — or of the last
    one overall when there is no such line, which is the baseline the next ``Starting job`` gets).
    Like Megatron, only ``Saved checkpoint`` counts: an async save line is written when the save is
    scheduled, before it is known to be durable.
    """
    start: Optional[float] = None
    start_flops: Optional[float] = None
    latest_flops = 0.0
    for event in events:
        if event.name == SAVED_CHECKPOINT:
            flops = event.number(FLOATING_POINT_OPERATIONS)
            if flops is not None:
                latest_flops = flops
        if event.world_size != world_size:
            start, start_flops = None, None
            continue
        if event.name == STARTING_JOB and start is None:
            start, start_flops = event.time, latest_flops
    return start, (latest_flops if start_flops is None else start_flops)


def longest_recent_save_s(path: str, saves: int = 5) -> Optional[float]:
    """The longest ``Save seconds`` among the last ``saves`` saves the log records (None: none, or no
    log): what the next save of the same job can be expected to take."""
    if not os.path.exists(path):
        return None
    recorded = [e.number(SAVE_SECONDS) for e in parse_events(path) if e.name in SAVE_EVENTS]
    recorded = [s for s in recorded if s is not None][-saves:]
    return max(recorded) if recorded else None


# --------------------------------------------------------------------------------------------------
# Writer


class ProgressLog:
    """Appends progress lines for rank 0 of the training loop.

    Every line is one ``write`` on an ``O_APPEND`` descriptor followed by ``fsync``, so a SIGKILL
    right after a call never loses that line and never interleaves half lines. Call order per run:
    :meth:`starting_job`, optionally :meth:`loaded_checkpoint`, :meth:`first_step`, any number of
    :meth:`saved_checkpoint`, then :meth:`ending_job` (or, for an in-job restart, :meth:`restart`
    followed by a new :meth:`starting_job`).

    ``clock`` returns epoch seconds; it is injectable so tests can write a log with known times.
    """

    def __init__(self, path: str, job_id: str, world_size: int, *, clock: Callable[[], float] = time.time):
        self.path = os.fspath(path)
        self.job_id = str(job_id)
        self.world_size = int(world_size)
        self.clock = clock
        self.restart_count = 0
        self._job_start: Optional[float] = None  # process start of this run (epoch)
        self._job_start_flops = 0.0
        self._cumulative: Optional[Tuple[Optional[float], float]] = None  # read from the file once

    # -- events ------------------------------------------------------------------------------------

    def starting_job(self, restart_count: int = 0, startup_s: Optional[float] = None,
                     device: Optional[str] = None) -> None:
        """Start a run (a new job, a requeue, or an in-job restart with a higher ``restart_count``).

        ``startup_s`` is how long the process has already been running (launch, imports, rendezvous);
        throughput and start-up time count from then, as Megatron counts from its process start.
        ``device`` is what the ranks compute on (see :data:`DEVICE`), for the report's device column.
        The existing file is read here, once, for the cumulative-throughput baseline.
        """
        now = self.clock()
        self.restart_count = int(restart_count)
        self._job_start = now - (startup_s or 0.0)
        self._job_start_flops = 0.0
        if self._cumulative is None:
            events = parse_events(self.path) if os.path.exists(self.path) else []
            self._cumulative = cumulative_baseline(events, self.world_size)
        start, flops = self._cumulative
        if start is None:  # this line is the first of this world size: it is the baseline
            self._cumulative = (parse_time(format_time(now)), flops)
        fields = [(RESTART_COUNT, str(self.restart_count))]
        if startup_s is not None:
            fields.append((SECONDS_SINCE_PROCESS_START, f"{startup_s:.1f}"))
        if device:
            fields.append((DEVICE, " ".join(device.split())))  # one line, one field: no tabs or newlines
        self._write(STARTING_JOB, fields, now)

    def loaded_checkpoint(self, iteration: int, load_s: float, flops_so_far: float = 0.0) -> None:
        """A checkpoint was loaded. ``flops_so_far`` (stored in the checkpoint) is where this job's
        FLOPs count starts, so job throughput counts only work done by this job."""
        self._job_start_flops = float(flops_so_far)
        self._write(LOADED_CHECKPOINT, [(ITERATION, str(iteration)), (LOAD_SECONDS, f"{load_s:.1f}")])

    def first_step(self, iteration: int, phases: Optional[str] = None) -> float:
        """The first training step of this run is done; logs and returns the start-up seconds
        (process start to now: launch, load, compilation, the first step itself). ``phases``: where
        they went (:meth:`bridge_hpc.training.process.startup.StartupPhases.describe`), logged as the field
        ``Start-up phases``."""
        now = self.clock()
        startup = now - self._started()
        fields = [(ITERATION, str(iteration)), (STARTUP_SECONDS, f"{startup:.1f}")]
        if phases:
            fields.append((STARTUP_PHASES, phases))
        self._write(FIRST_STEP, fields, now)
        return startup

    def saved_checkpoint(
        self,
        iteration: int,
        flops_so_far: float,
        tokens: float,
        save_s: Optional[float] = None,
        *,
        async_: bool = False,
    ) -> Tuple[float, float]:
        """A checkpoint was saved (or, with ``async_``, scheduled); returns (job, cumulative) TFLOP/s/GPU.

        ``flops_so_far`` counts from iteration 0 of the model (Megatron's
        ``num_floating_point_operations_so_far``); ``tokens`` = consumed samples x sequence length.
        The standard fields come first, in Megatron's order; ``Save seconds`` (time training was
        blocked by the save) is appended after them.
        """
        now = self.clock()
        scale = 1e12 * self.world_size
        job_tp = (flops_so_far - self._job_start_flops) / (max(now - self._started(), 1e-9) * scale)
        cum_start, cum_flops = self._cumulative or (now, 0.0)
        cum_tp = (flops_so_far - cum_flops) / (max(now - cum_start, 1e-9) * scale)
        fields = [
            (ITERATION, str(iteration)),
            (JOB_THROUGHPUT, f"{job_tp:.1f} TFLOP/s/GPU"),
            (CUMULATIVE_THROUGHPUT, f"{cum_tp:.1f} TFLOP/s/GPU"),
            (FLOATING_POINT_OPERATIONS, f"{flops_so_far:.2e}"),
            ("Tokens (in billions)", f"{tokens / 1e9:.2f}"),
        ]
        if save_s is not None:
            fields.append((SAVE_SECONDS, f"{save_s:.1f}"))
        self._write(SAVING_ASYNC if async_ else SAVED_CHECKPOINT, fields, now)
        return job_tp, cum_tp

    def ending_job(self, reason: str, iteration: int, steps_lost: int) -> None:
        """The run ends. ``reason`` is one of :data:`END_REASONS`; ``steps_lost`` = steps done since
        the last checkpoint, which the next run will redo."""
        if reason not in END_REASONS:
            raise ValueError(f"reason must be one of {', '.join(END_REASONS)}, got {reason!r}")
        self._write(
            ENDING_JOB,
            [
                (REASON, reason),
                (ITERATION, str(iteration)),
                (STEPS_LOST, str(steps_lost)),
                (RESTART_COUNT, str(self.restart_count)),
            ],
        )

    def restart(self, cause: str, lost_s: float) -> None:
        """Fault tolerance restarts training inside this allocation; call before the next
        :meth:`starting_job`. ``lost_s`` = seconds from the fault to now (detection and teardown),
        which the report charges to the run that failed."""
        self._write(RESTART, [(CAUSE, cause), (LOST_SECONDS, f"{lost_s:.1f}")])

    def checkpoint_fallback(self, damaged: str, moved_to: str, reason: str, using: str) -> None:
        """The newest checkpoint failed verification or loading: it was moved aside to ``moved_to`` and
        the run loads ``using`` instead (a folder name, or "none"). Recorded so that a person reading the
        log sees why the run resumed further back than the tracker said."""
        self._write(CHECKPOINT_FALLBACK, [("Damaged", damaged), ("Moved to", moved_to), (REASON, reason),
                                          ("Using", using)])

    def result_validation(self, iteration: int, check: str, diagnosis: str, ranks: int, action: str) -> None:
        """Step ``iteration`` failed ``check`` (e.g. ``nan_loss``, ``spiky_loss``) on ``ranks`` ranks and was
        re-run on the same batch: ``diagnosis`` "deterministic" (the re-run reproduced it) or "transient";
        ``action`` "continue" (training went on with the re-run's result) or "stop"."""
        self._write(RESULT_VALIDATION, [(ITERATION, str(iteration)), ("Check", check), ("Diagnosis", diagnosis),
                                        ("Ranks", str(ranks)), ("Action", action)])

    def checkpoint_save_failed(self, iteration: int, failures: int, stop: bool, reason: str) -> None:
        """A background save of ``iteration`` failed (``failures`` in a row); the run stops (``stop``)
        or goes on and retries at its next save. Recorded so that a gap between saved checkpoints has
        its cause next to it."""
        self._write(CHECKPOINT_SAVE_FAILED, [(ITERATION, str(iteration)), ("Failures in a row", str(failures)),
                                             ("Action", "stop" if stop else "retry"), (REASON, reason)])

    def save_interval(self, fields: List[Tuple[str, str]]) -> None:
        """The run chose its checkpoint interval (``save_interval = "auto"``): ``fields`` are
        :meth:`bridge_hpc.contracts.save_interval.Choice.progress_fields`."""
        self._write(SAVE_INTERVAL, [(key, " ".join(value.split())) for key, value in fields])

    # -- plumbing ----------------------------------------------------------------------------------

    def _started(self) -> float:
        if self._job_start is None:
            raise RuntimeError("ProgressLog.starting_job() must be called first")
        return self._job_start

    def _write(self, event: str, fields: List[Tuple[str, str]], now: Optional[float] = None) -> None:
        stamp = format_time(self.clock() if now is None else now)
        parts = [stamp, f"Job ID: {self.job_id}", f"# GPUs: {self.world_size}", event]
        parts += [f"{key}: {value}" for key, value in fields]
        line = "\t".join(parts) + "\n"
        directory = os.path.dirname(self.path) or "."
        os.makedirs(directory, exist_ok=True)
        created = not os.path.exists(self.path)
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            if not created and _ends_without_newline(fd):
                line = "\n" + line  # a killed writer left a half line: do not glue ours onto it
            os.write(fd, line.encode("utf-8"))
            os.fsync(fd)
        finally:
            os.close(fd)
        if created:  # make the new directory entry durable too
            dir_fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)


def _ends_without_newline(fd: int) -> bool:
    size = os.fstat(fd).st_size
    return size > 0 and os.pread(fd, 1, size - 1) != b"\n"
