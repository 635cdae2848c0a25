"""Hang detection and in-job restart with nvidia-resiliency-ext (``[ft]``, Bridge's ``ft`` section).

The ranks run under ``ft_launcher`` (see :mod:`bridge_hpc.launch.ft_launch`); the launcher starts one
*rank monitor* process per rank, which kills its rank when the rank stops reporting progress for
longer than a timeout; the launcher then restarts all workers of the job in place (``--max-restarts``)
and they resume from the latest checkpoint. This module is the rank side: a small object that the
training loop calls at a few fixed points. Every method is a no-op when FT is off or the process was
not started by ``ft_launcher`` (one log line says so), so the loop can call it unconditionally.

Where the loop calls it::

    ft = FaultTolerance(cfg.ft, checkpoint_dir=cfg.checkpoint.save)   # cfg.ft may be None
    ft.setup()                        # right after torch.distributed.init_process_group,
                                      # BEFORE building the model and loading the checkpoint
    state = load_checkpoint(...)      # start-up, covered by section "setup" (its own allowance,
                                      # through the end of the run's first step: the warm-up)
    if state is not None:
        ft.load_state_dict(state.get("fault_tolerance", {}))   # optional, see below
        ft.on_checkpoint_loaded()
    while iteration < train_iters:
        ft.step_start(iteration)      # opens "step" (from the second step of the run on)
        ft.maybe_simulate_fault(iteration)
        ...forward / backward / optimizer step...
        ft.step_end(iteration)        # first call closes "setup"; may all_reduce (timeouts
                                      # calculation) on a fixed iteration
        if time_to_save:
            with ft.checkpointing():  # a long save is not a hang
                save_checkpoint(..., extra={"fault_tolerance": ft.state_dict()})
    ft.shutdown()                     # normal end: computes the out-of-section timeout, closes

Two progress APIs exist in nvidia-resiliency-ext; the one used is chosen at run time:

* **sections** (``RankMonitorClient.start_section``/``end_section``), used when the client has them
  AND the launcher was given timeouts for the sections ``setup``, ``step`` and ``checkpointing``
  (``--ft-rank-section-timeouts=setup:..,step:..,checkpointing:..``, which
  :func:`bridge_hpc.launch.ft_launch.ft_launcher_argv` always passes). Each phase has its own timeout;
  time between steps (logging, evaluation) counts against ``rank_out_of_section_timeout``.
* **heartbeats** (``send_heartbeat``) otherwise: one heartbeat per step; the first heartbeat must
  come within ``initial_rank_heartbeat_timeout`` (start-up + checkpoint load), later ones within
  ``rank_heartbeat_timeout``. :meth:`checkpointing` then sends keep-alive heartbeats from a thread
  while the save runs, for at most ``checkpoint_allowance_s``.

Computed timeouts (``calc_ft_timeouts = true``): the package's timeouts calculator records the
longest observed interval of each kind; on fixed points (same iteration on every rank, as it
all_reduces) this module asks the client to turn them into timeouts (observed max x the launcher's
``safety_factor``, merged by EMA with previously computed values): ``step`` after
``min_iters_for_step_timeout`` steps, ``setup`` (start-up, load and first step) at the end of the
first step of a run that loaded a checkpoint,
``checkpointing`` after the first save, out-of-section at :meth:`shutdown`. They are written by rank 0
to ``<checkpoint_dir>/ft_state.json`` (read back by :meth:`setup` *before* the checkpoint load, so the
load already runs under the computed setup allowance) and are also available as :meth:`state_dict`
for the checkpoint itself; :meth:`load_state_dict` re-applies them (now or at :meth:`setup`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import random
import signal
import threading
import time
from typing import Any, Dict, Iterator, Mapping, Optional

from bridge_hpc.contracts import run_folder
from bridge_hpc.training.config import FaultToleranceConfig

logger = logging.getLogger("bridge_hpc.ft")

SECTION_SETUP = "setup"
SECTION_STEP = "step"
SECTION_CHECKPOINTING = "checkpointing"
SECTIONS = (SECTION_SETUP, SECTION_STEP, SECTION_CHECKPOINTING)

STATE_FILE = run_folder.FT_STATE_FILE
# Environment set by ft_launcher in every worker (the rank monitor's socket).
FT_RANK_MONITOR_IPC_SOCKET_ENV = "FT_RANK_MONITOR_IPC_SOCKET"
# ft_launcher (torchrun) counts worker-group restarts in this variable.
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"

FAULT_TYPES = ("rank_hung", "rank_killed")


def under_ft_launcher(env: Optional[Mapping[str, str]] = None) -> bool:
    """True when this process is a worker started by ``ft_launcher`` (its rank monitor is reachable)."""
    env = os.environ if env is None else env
    return bool(env.get(FT_RANK_MONITOR_IPC_SOCKET_ENV))


class FaultTolerance:
    """Rank-side fault tolerance for one training process. See the module docstring for the call order.

    Args:
        cfg: the ``[ft]`` section (:class:`bridge_hpc.training.config.FaultToleranceConfig`); None: off.
        checkpoint_dir: the checkpoint folder (``checkpoint.save``); ``ft_state.json`` lives there.
            None: computed timeouts only travel through :meth:`state_dict`.
        rank: global rank; default ``$RANK`` (torch.distributed's rank once it is up).
        min_iters_for_step_timeout: steps observed before the step timeout is computed.
        checkpoint_allowance_s: heartbeat mode only: the longest save kept alive by :meth:`checkpointing`.
        min_computed_timeout_s: floor for every computed timeout (default: ``cfg.min_computed_timeout_s``).
            The calculator multiplies the longest interval seen in one run; a short first run (a quick set-up without a checkpoint
            load, no evaluation between steps) would otherwise leave timeouts that kill the next
            run's longer but healthy phases.
        async_ipc: send section/heartbeat messages from a sender thread, so a step pays a queue put
            (microseconds) instead of an IPC round trip to the monitor (~0.1-0.5 ms, more on a busy
            node). Order is kept; a hung main thread stops queueing, so hangs are still seen. Timeout
            calculation, state and shutdown wait for the queue to drain first.
        heartbeat_interval_s: heartbeat mode: at most one heartbeat per this many seconds (capped to a
            quarter of the heartbeat timeout). Sections are reported on every step.
        progress_mark_interval_s: how often rank 0 refreshes ``<checkpoint_dir>/ft_progress_mark``
            (time of the latest finished step), from which :meth:`seconds_lost_before_restart`
            tells an in-job restart how long the fault cost. 0 disables it.
    """

    def __init__(
        self,
        cfg: Optional[FaultToleranceConfig],
        checkpoint_dir: Optional[str] = None,
        *,
        rank: Optional[int] = None,
        min_iters_for_step_timeout: int = 16,
        checkpoint_allowance_s: float = 3600.0,
        progress_mark_interval_s: float = 5.0,
        min_computed_timeout_s: Optional[float] = None,
        async_ipc: bool = True,
        heartbeat_interval_s: float = 1.0,
    ) -> None:
        cfg = cfg if cfg is not None else FaultToleranceConfig()  # no [ft]: its defaults, FT off
        self.cfg = cfg
        self.enabled = cfg.enable_ft_package
        self.calc_timeouts = self.enabled and cfg.calc_ft_timeouts
        self.checkpoint_dir = os.fspath(checkpoint_dir) if checkpoint_dir else None
        self._rank = rank
        self.min_iters_for_step_timeout = max(1, int(min_iters_for_step_timeout))
        self.checkpoint_allowance_s = float(checkpoint_allowance_s)
        self.progress_mark_interval_s = float(progress_mark_interval_s)
        self.min_computed_timeout_s = float(cfg.min_computed_timeout_s if min_computed_timeout_s is None
                                            else min_computed_timeout_s)
        self._state_from_file = False
        self.async_ipc = bool(async_ipc)
        self._sender: Optional[_Sender] = None
        self._hb_interval = float(heartbeat_interval_s)
        self._last_hb = float("-inf")
        self._send_failed = False
        self.restart_count = int(os.environ.get(RESTART_COUNT_ENV, "0") or 0)

        self.client = None  # RankMonitorClient once connected
        self.mode: Optional[str] = None  # "sections" | "heartbeats" | None (inactive)
        self._pending_state: Optional[Dict[str, Any]] = None
        self._setup_open = False
        self._steps_seen = 0
        self._checkpoint_loaded = False
        self._saves_seen = 0
        self._calculated = set()  # which timeouts were computed in this run
        self._last_mark = 0.0
        self._setup_time: Optional[float] = None
        self._fault: Optional[Dict[str, Any]] = None  # armed simulated fault

    # -- properties --------------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        """True when progress is reported to a rank monitor."""
        return self.mode is not None

    @property
    def rank(self) -> int:
        if self._rank is not None:
            return self._rank
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                return dist.get_rank()
        except ImportError:  # pragma: no cover
            pass
        return int(os.environ.get("RANK", "0") or 0)

    def timeouts(self) -> Dict[str, Any]:
        """The timeouts in force (as the client knows them), for logs and tests; {} when inactive."""
        if self.client is None:
            return {}
        out: Dict[str, Any] = {"mode": self.mode}
        hb = getattr(self.client, "hb_timeouts", None)
        if hb is not None:
            out["heartbeat"] = {"initial": hb.initial, "subsequent": hb.subsequent,
                                "calculated": bool(hb.were_calculated)}
        st = getattr(self.client, "section_timeouts", None)
        if st is not None:
            out["section"] = dict(st.section)
            out["out_of_section"] = st.out_of_section
            out["calculated_sections"] = sorted(st.calculated_sections or ())
        return out

    # -- life cycle --------------------------------------------------------------------------------

    def setup(self) -> bool:
        """Connect to the rank monitor and open section ``setup``; returns :attr:`active`.

        Call once, after ``torch.distributed`` is initialised (the fault simulation and the
        timeouts calculation use it) and before the model is built and the checkpoint loaded.
        """
        self._setup_time = time.monotonic()
        if not self.enabled:
            logger.debug("fault tolerance: inactive ([ft] enable_ft_package is false)")
            return False
        if not under_ft_launcher():
            logger.warning(
                "fault tolerance: inactive: [ft] enable_ft_package = true but this process was not "
                "started by ft_launcher (%s is not set); hangs will not be detected",
                FT_RANK_MONITOR_IPC_SOCKET_ENV,
            )
            return False
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

        client = RankMonitorClient()
        state = self._read_state_file()
        self._state_from_file = state is not None
        if state is None:
            state = self._pending_state
        if state:
            client.load_state_dict(state)  # applied by init_workload_monitoring
        client.init_workload_monitoring()
        self.client = client
        has_sections = all(hasattr(client, m) for m in ("start_section", "end_section", "end_all_sections"))
        configured = set(getattr(client.cfg, "rank_section_timeouts", {}) or {})
        if has_sections and set(SECTIONS) <= configured:
            self.mode = "sections"
            # The monitor also enforces heartbeat timeouts; a rank that reports by sections sends no
            # heartbeats, so switch them off (through the public state API) or the monitor would
            # kill it initial_rank_heartbeat_timeout seconds after start.
            hb = client.hb_timeouts
            if hb is not None and (hb.initial is not None or hb.subsequent is not None):
                client.load_state_dict({client.CURRENT_TIMEOUTS_STATE_KEY: {
                    "heartbeat": {"initial": None, "subsequent": None, "were_calculated": False}}})
            client.start_section(SECTION_SETUP)
            self._setup_open = True
        elif hasattr(client, "send_heartbeat"):
            self.mode = "heartbeats"
            if has_sections and configured:
                logger.warning("fault tolerance: launcher section timeouts %s lack some of %s: using heartbeats",
                               sorted(configured), list(SECTIONS))
        else:  # pragma: no cover - no known version lacks both
            logger.warning("fault tolerance: inactive: RankMonitorClient has neither sections nor heartbeats")
            client.shutdown_workload_monitoring()
            self.client = None
            return False
        if self.mode == "heartbeats":
            sub = client.hb_timeouts.subsequent
            if sub is not None:
                self._hb_interval = min(self._hb_interval, sub / 4.0)
        if self.async_ipc:
            self._sender = _Sender()
        self._arm_simulated_fault()
        logger.info("fault tolerance: active (%s API), restart %d, timeouts %s",
                    self.mode, self.restart_count, self.timeouts())
        return True

    def on_checkpoint_loaded(self) -> None:
        """A checkpoint was loaded (still inside ``setup``): the setup time of this run is a valid
        sample for the setup timeout, which must allow for a load."""
        self._checkpoint_loaded = True

    def step_start(self, iteration: int) -> None:
        """At the top of every training iteration (before the batch is fetched).

        The first step of a run stays inside ``setup``: it is the warm-up (lazy allocations,
        kernel selection, the first collectives on fresh communicators) and can take many times a
        steady step, so judging it by a step timeout computed from steady steps would restart a
        healthy run right after every requeue or in-job restart."""
        if self.mode != "sections" or self._setup_open:
            return
        self._send(self.client.start_section, SECTION_STEP)

    def step_end(self, iteration: int) -> None:
        """After the optimizer step of every iteration. Collective when a timeout is computed here
        (the same iteration count on every rank), so every rank must call it every iteration."""
        mode = self.mode
        if mode is None:
            return
        if mode == "sections":
            if self._setup_open:  # the run's first step: the end of set-up (see step_start)
                self._send(self.client.end_section, SECTION_SETUP)
                self._setup_open = False
            else:
                self._send(self.client.end_section, SECTION_STEP)
        else:
            self._maybe_heartbeat()
        self._steps_seen += 1
        if self.calc_timeouts and (self._steps_seen == 1 or self._steps_seen == self.min_iters_for_step_timeout):
            self._update_timeouts(at_first_step=self._steps_seen == 1)
        if self.progress_mark_interval_s > 0:
            now = time.time()
            if now - self._last_mark >= self.progress_mark_interval_s:
                self.mark_progress(now)

    def heartbeat(self) -> None:
        """An extra sign of life for long phases outside a step (e.g. evaluation in heartbeat mode);
        no-op in sections mode (there, time outside sections has its own timeout)."""
        if self.mode == "heartbeats":
            self._maybe_heartbeat()

    def _maybe_heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._last_hb >= self._hb_interval:
            self._last_hb = now
            self._send(self.client.send_heartbeat)

    @contextlib.contextmanager
    def checkpointing(self) -> Iterator[None]:
        """Wrap a checkpoint save (collective on all ranks) so it is judged by the checkpointing
        timeout, not the step timeout."""
        mode = self.mode
        if mode is None:
            yield
            return
        if mode == "sections":
            self._send(self.client.start_section, SECTION_CHECKPOINTING)
            try:
                yield
            finally:
                self._send(self.client.end_section, SECTION_CHECKPOINTING)
            self._saves_seen += 1
            if self.calc_timeouts and self._saves_seen == 1:
                self._update_timeouts(sections=[SECTION_CHECKPOINTING])
            return
        # heartbeats: keep the rank alive from a thread while the main thread saves
        stop = threading.Event()
        hb = self.client.hb_timeouts
        period = max(0.5, min(30.0, (hb.subsequent or 60.0) / 4.0))
        deadline = time.monotonic() + self.checkpoint_allowance_s

        def keep_alive() -> None:
            while not stop.wait(period) and time.monotonic() < deadline:
                self._send(self.client.send_heartbeat)

        thread = threading.Thread(target=keep_alive, name="ft-checkpoint-keepalive", daemon=True)
        self._send(self.client.send_heartbeat)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            self._last_hb = time.monotonic()
            self._send(self.client.send_heartbeat)

    def shutdown(self) -> None:
        """Normal end of training (every rank): compute the out-of-section timeout, close sections,
        disconnect. Not for the exception path: there, just exit (the monitor sees the rank end)."""
        if self.client is None:
            return
        try:
            if self.mode == "sections":
                if self.calc_timeouts and self._steps_seen > 0:
                    self._update_timeouts(sections=[SECTION_STEP], out_of_section=True)
                self._flush()
                self.client.end_all_sections()
            self._flush()
            self.client.shutdown_workload_monitoring()
        finally:
            if self._sender is not None:
                self._sender.stop()
                self._sender = None
            self.client = None
            self.mode = None

    # -- sending -----------------------------------------------------------------------------------

    def _send(self, fn, *args) -> None:
        """Report progress: through the sender thread (the loop only pays a queue put) or directly."""
        if self._sender is not None:
            self._sender.put(fn, args)
            return
        try:
            fn(*args)
        except Exception as exc:  # the monitor went away: training goes on unmonitored
            if not self._send_failed:
                self._send_failed = True
                logger.warning("fault tolerance: reporting to the rank monitor failed: %s", exc)

    def _flush(self) -> None:
        """Wait until every queued message reached the monitor (before using the client directly)."""
        if self._sender is not None:
            self._sender.flush()

    # -- computed timeouts -------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """The computed timeouts (same on every rank), to store in the checkpoint; {} if none."""
        if self.client is not None:
            self._flush()
            return dict(self.client.state_dict())
        return dict(self._pending_state or {})

    def load_state_dict(self, state: Optional[Mapping[str, Any]]) -> None:
        """Re-apply timeouts from :meth:`state_dict`: at once when connected, else at :meth:`setup`.

        Ignored when :meth:`setup` found ``<checkpoint_dir>/ft_state.json``: that file is rewritten
        whenever timeouts change (also after the last save, at :meth:`shutdown`), so it is at least as
        recent as any checkpoint in that folder. The checkpoint's copy matters when the folder has no
        such file (e.g. a checkpoint copied from elsewhere)."""
        if not state:
            return
        if self._state_from_file:
            logger.info("fault tolerance: timeouts from %s kept; the checkpoint's copy is not applied",
                        self._state_path())
            return
        self._pending_state = dict(state)
        if self.client is not None:
            self._flush()
            self.client.load_state_dict(self._pending_state)

    def _update_timeouts(self, sections=None, out_of_section: bool = False, at_first_step: bool = False) -> None:
        client = self.client
        self._flush()  # the calculator is fed by the sender thread
        try:
            if self.mode == "heartbeats":
                if self._steps_seen >= self.min_iters_for_step_timeout or out_of_section:
                    if client.calculate_and_set_hb_timeouts(skip_if_not_ready=True):
                        self._calculated.add("heartbeat")
                    else:
                        return
                else:
                    return
            else:
                if sections is None:
                    sections = []
                    if at_first_step and self._checkpoint_loaded:
                        sections.append(SECTION_SETUP)
                    if self._steps_seen >= self.min_iters_for_step_timeout:
                        sections.append(SECTION_STEP)
                if not sections and not out_of_section:
                    return
                ok = client.calculate_and_set_section_timeouts(
                    selected_sections=sections, calc_out_of_section=out_of_section, skip_if_not_ready=True
                )
                if not ok:
                    return
                self._calculated.update(sections)
        except Exception as exc:  # never let bookkeeping kill training
            logger.warning("fault tolerance: computing timeouts failed: %s", exc)
            return
        self._apply_floor()
        logger.info("fault tolerance: computed timeouts: %s", self.timeouts())
        self._write_state_file(client.state_dict())

    def _apply_floor(self) -> None:
        """Raise computed timeouts below ``min_computed_timeout_s`` (through the public state API)."""
        floor = self.min_computed_timeout_s
        if floor <= 0:
            return
        state = self.client.state_dict()
        current = state.get(self.client.CURRENT_TIMEOUTS_STATE_KEY, {})
        changed = False
        hb = current.get("heartbeat")
        if hb:
            for key in ("initial", "subsequent"):
                if hb.get(key) is not None and hb[key] < floor:
                    hb[key], changed = floor, True
        sec = current.get("section")
        if sec:
            for name in sec.get("calculated_sections", []):
                value = sec["section"].get(name)
                if value is not None and value < floor:
                    sec["section"][name], changed = floor, True
            oos = sec.get("out_of_section")
            if sec.get("is_out_of_section_calculated") and oos is not None and oos < floor:
                sec["out_of_section"], changed = floor, True
        if changed:
            self.client.load_state_dict(state)

    def _state_path(self) -> Optional[str]:
        return os.path.join(self.checkpoint_dir, STATE_FILE) if self.checkpoint_dir else None

    def _read_state_file(self) -> Optional[Dict[str, Any]]:
        path = self._state_path()
        if not path or not os.path.exists(path):
            return None
        try:
            with open(path, "r", encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError) as exc:
            logger.warning("fault tolerance: ignoring unreadable %s: %s", path, exc)
            return None

    def _write_state_file(self, state: Mapping[str, Any]) -> None:
        path = self._state_path()
        if not path or self.rank != 0:
            return
        _atomic_write(path, json.dumps(state, indent=1, sort_keys=True))

    # -- in-job restart bookkeeping ----------------------------------------------------------------

    def _mark_path(self) -> Optional[str]:
        return run_folder.checkpoint_file(self.checkpoint_dir, run_folder.FT_PROGRESS_MARK) if self.checkpoint_dir else None

    def mark_progress(self, now: Optional[float] = None) -> None:
        """Rank 0 records ``now`` as this run's latest progress in ``<checkpoint_dir>/ft_progress_mark``.
        The loop calls it once its set-up has read the previous mark (:meth:`seconds_lost_before_restart`),
        so that a run that fails before its first step is charged the time from its start, never 0 s,
        and :meth:`step_end` refreshes it every ``progress_mark_interval_s``."""
        now = time.time() if now is None else now
        self._last_mark = now
        self._write_progress_mark(now)

    def _write_progress_mark(self, now: float) -> None:
        path = self._mark_path()
        if path and self.mode is not None and self.rank == 0:  # under ft_launcher only
            try:
                _atomic_write(path, f"{now:.3f}\n", fsync=False)
            except OSError:
                pass

    def seconds_lost_before_restart(self, now: Optional[float] = None) -> Optional[float]:
        """For an in-job restart (:attr:`restart_count` > 0): seconds from the previous run's last
        progress mark (<= ``progress_mark_interval_s`` before its last step, or its set-up if it finished
        no step: :meth:`mark_progress`) to ``now``; the loop passes
        it to ``ProgressLog.restart(cause, lost_s)``. None on a first run or when unknown."""
        path = self._mark_path()
        if self.restart_count <= 0 or not path:
            return None
        try:
            with open(path, "r", encoding="utf-8") as f:
                last = float(f.read().strip())
        except (OSError, ValueError):
            return None
        return max(0.0, (time.time() if now is None else now) - last)

    # -- simulated faults --------------------------------------------------------------------------

    def _arm_simulated_fault(self) -> None:
        """Decide (the same on every rank, without a collective) which rank fails, how and when.

        One simulated fault per ``ft_launcher`` run: workers restarted in the job
        (``TORCHELASTIC_RESTART_COUNT`` > 0) do not fail again, so the restart can be seen to succeed.
        """
        cfg = self.cfg
        if not (self.enabled and cfg.simulate_fault) or self.restart_count > 0:
            return
        seed = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID") or "bridge_hpc"
        rng = random.Random(f"{seed}:{os.environ.get('SLURM_RESTART_COUNT', '0')}")
        fault_type = cfg.simulated_fault_type
        if fault_type == "random":
            fault_type = rng.choice(FAULT_TYPES)
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        target = cfg.simulated_fault_rank
        if target is None:
            target = rng.randrange(world)
        delay = float(cfg.simulated_fault_base_delay)
        if self.rank != int(target):
            return
        self._fault = {"type": fault_type, "at": (self._setup_time or time.monotonic()) + delay}
        logger.warning("fault tolerance: simulated fault %s armed on rank %d, %.0f s after setup",
                       fault_type, self.rank, delay)

    def maybe_simulate_fault(self, iteration: int) -> None:
        """Right after :meth:`step_start`: if this rank is the one chosen to fail and
        ``simulated_fault_base_delay`` seconds have passed since :meth:`setup`, fail now:
        ``rank_hung`` stops reporting progress and sleeps (the monitor must kill it),
        ``rank_killed`` sends itself SIGKILL. Costs one comparison per step otherwise."""
        fault = self._fault
        if fault is None or time.monotonic() < fault["at"]:
            return
        self._fault = None
        print(f"bridge_hpc.ft: SIMULATED FAULT {fault['type']} rank {self.rank} iteration {iteration} "
              f"at {time.time():.3f}", flush=True)
        if fault["type"] == "rank_killed":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # rank_hung: the main thread never comes back to report progress
            time.sleep(3600)


class _Sender:
    """One daemon thread that sends the queued client calls in order."""

    def __init__(self) -> None:
        self._queue: "queue.Queue" = queue.Queue()
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="ft-sender", daemon=True)
        self._thread.start()

    def put(self, fn, args) -> None:
        self._queue.put((fn, args))

    def flush(self) -> None:
        self._queue.join()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                fn, args = item
                try:
                    fn(*args)
                except Exception as exc:  # the monitor went away (e.g. the launcher is stopping us)
                    if not self._failed:
                        self._failed = True
                        logger.warning("fault tolerance: reporting to the rank monitor failed: %s", exc)
            finally:
                self._queue.task_done()


def _atomic_write(path: str, text: str, fsync: bool = True) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
