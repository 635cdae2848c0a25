"""GPU-only checks of the nvidia-resiliency-ext paths that need CUDA (run by tests/test_gpu_resiliency.py
as one process with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set). Writes <out>/result.json.

``straggler``: the "nvrx" backend (CUPTI kernel timings) of StragglerDetector: set-up, timed
sections, a report with this rank's scores, shutdown.
``inprocess``: pretrain() of the tiny GPT with ``[inprocess_restart] enabled``; the forward step raises
once at step 12; the wrapper must re-run training in the same process, resuming from the step-10
checkpoint, and finish. ``reference``: the same run without the fault.
"""

import json
import os
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)


def straggler(out):
    import torch
    import torch.distributed as dist

    from bridge_hpc.training.config import NVRxStragglerDetectionConfig
    from bridge_hpc.training.resilience.straggler import StragglerDetector

    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    det = StragglerDetector(NVRxStragglerDetectionConfig(enabled=True, report_time_interval=1.0))
    det.setup()
    a = torch.randn(2048, 2048, device="cuda")
    reports, start = [], time.time()
    it = 0
    while time.time() - start < 5.0:
        det.step_start()
        for _ in range(8):
            a = torch.tanh(a @ a)
        torch.cuda.synchronize()
        det.step_end()
        det.check(it)
        if det.last_report is not None and (not reports or reports[-1]["iteration"] != det.last_report.iteration):
            reports.append(det.last_report.to_dict())
        it += 1
    backend = det.backend
    det.shutdown()
    dist.destroy_process_group()
    return {"backend": backend, "reports": reports, "steps": it}


def straggler_pair(out):
    """One of 2 ranks (one GPU each); the test slows rank 1's GPU with a competing process. Both ranks
    stop at the same report (stop_if_detected)."""
    import torch
    import torch.distributed as dist

    from bridge_hpc.training.config import NVRxStragglerDetectionConfig
    from bridge_hpc.training.resilience.straggler import StragglerDetector

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    det = StragglerDetector(NVRxStragglerDetectionConfig(enabled=True, report_time_interval=2.0,
                                                         stop_if_detected=True))
    det.setup()
    a = torch.randn(4096, 4096, device="cuda")
    reports, stopped_at, start = [], None, time.time()
    it = 0
    while time.time() - start < 60.0:
        det.step_start()
        for _ in range(8):
            a = torch.tanh(a @ a)
        torch.cuda.synchronize()
        det.step_end()
        dist.all_reduce(a[0, :8])  # the ranks advance together, as in training
        stop = det.check(it)
        if det.last_report is not None and (not reports or reports[-1]["iteration"] != det.last_report.iteration):
            reports.append(det.last_report.to_dict())
        if stop:
            stopped_at = it
            break
        it += 1
    backend = det.backend
    det.shutdown()
    dist.destroy_process_group()
    return {"backend": backend, "reports": reports, "stopped_at": stopped_at, "steps": it}


def gpu_hog(out):
    """Keeps the GPU named by LOCAL_RANK busy until killed: a noisy neighbour for straggler_pair."""
    import torch

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    b = torch.randn(8192, 8192, device="cuda")
    open(os.path.join(out, "hog_ready"), "w").close()
    while True:
        b = torch.tanh(b @ b)
        torch.cuda.synchronize()


def train(out, fault):
    from bridge_hpc.rank import build_config
    from bridge_hpc.training.engine import model as gpt
    from bridge_hpc.training.pretrain import pretrain

    overrides = [f"job.run_dir={out}", "train.train_iters=20", "train.eval_interval=0", "logger.log_interval=1",
                 "checkpoint.save_interval=5", "checkpoint.most_recent_k=-1", "logger.log_progress=true",
                 "model.hidden_dropout=0.0", "model.attention_dropout=0.0"]
    if fault:
        overrides += ["inprocess_restart.enabled=true", "inprocess_restart.soft_timeout=30",
                      "inprocess_restart.hard_timeout=45", "inprocess_restart.heartbeat_timeout=30",
                      "inprocess_restart.heartbeat_interval=5",
                      "inprocess_restart.barrier_timeout=60", "inprocess_restart.completion_timeout=60"]
    cfg = build_config(os.path.join(ROOT, "tests", "data", "tiny.toml"), overrides)
    faults = []

    def forward_step(state, data_iterator, model):
        if fault and state.train_state.step == 12 and not faults:
            faults.append(time.time())
            raise RuntimeError("injected fault at step 12")
        return gpt.forward_step(state, data_iterator, model)

    pretrain(cfg, forward_step)
    return {"faults": len(faults)}


def main():
    mode, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    if mode == "straggler":
        result = straggler(out)
    elif mode == "straggler_pair":
        result = straggler_pair(out)
    elif mode == "gpu_hog":
        gpu_hog(out)
        return
    else:
        result = train(out, fault=mode == "inprocess")
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
