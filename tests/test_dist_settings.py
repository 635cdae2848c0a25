"""``[dist]``'s megatron settings act on the real torch.distributed / megatron-core set-up: gloo groups,
the rank order, the timeout after the first step, the JIT fuser (issue 27)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from warm_ranks import run_ranks

from bridge_hpc.training.config import DistributedInitConfig

sys.path.insert(0, os.path.dirname(__file__))
from bridge_test_helpers import free_port  # noqa: E402
from test_seed_config import _python_built  # noqa: E402


@pytest.fixture
def gloo_world():
    """A torch.distributed gloo world of one, without megatron-core's groups (the test makes them)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    # The rendezvous variables are put back afterwards: a MASTER_PORT left in this process's
    # environment would reach every job a later test submits (sbatch exports it), and two such jobs
    # on one node would then bind the same port.
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.mark.parametrize("use_gloo", [True, False])
def test_use_gloo_process_groups_decides_whether_megatron_core_makes_them(gloo_world, use_gloo):
    from megatron.core import parallel_state

    from bridge_hpc.training.engine import parallel

    cfg = _python_built()
    cfg.dist.use_gloo_process_groups = use_gloo
    parallel.initialize(cfg)
    assert (parallel_state._DATA_PARALLEL_GROUP_GLOO is not None) == use_gloo


def test_use_tp_pp_dp_mapping_is_megatron_cores_rank_order(gloo_world, monkeypatch):
    from megatron.core import parallel_state

    from bridge_hpc.training.engine import parallel

    seen = {}
    real = parallel_state.initialize_model_parallel
    monkeypatch.setattr(parallel_state, "initialize_model_parallel", lambda **kw: (seen.update(kw), real(**kw)))
    cfg = _python_built()
    cfg.dist.use_tp_pp_dp_mapping = True
    parallel.initialize(cfg)
    assert seen["order"] == "tp-cp-ep-pp-dp" and seen["create_gloo_process_groups"] is True


def test_the_short_timeout_reaches_every_process_group_after_the_first_step(gloo_world, monkeypatch):
    import datetime

    import torch.distributed.distributed_c10d as c10d

    from bridge_hpc.training.engine import parallel

    set_to = []
    monkeypatch.setattr(c10d, "_set_pg_timeout", lambda timeout, group: set_to.append((timeout, group)))
    cfg = _python_built()
    parallel.set_timeout_after_init(cfg)
    assert set_to == []  # unset: start-up's timeout stays
    cfg.dist.distributed_timeout_seconds_after_init = 45
    parallel.set_timeout_after_init(cfg)
    assert set_to and all(t == datetime.timedelta(seconds=45) for t, _ in set_to)
    assert {g for _, g in set_to} == set(c10d._world.pg_map)


def test_disable_jit_fuser_turns_torchscripts_fusers_off():
    from bridge_hpc.training.pretrain import disable_jit_fuser

    before = (torch._C._jit_texpr_fuser_enabled(), torch._C._jit_can_fuse_on_cpu(), torch._C._jit_can_fuse_on_gpu())
    try:
        disable_jit_fuser()
        assert (torch._C._jit_texpr_fuser_enabled(), torch._C._jit_can_fuse_on_cpu(),
                torch._C._jit_can_fuse_on_gpu()) == (False, False, False)
    finally:
        torch._C._jit_set_texpr_fuser_enabled(before[0])
        torch._C._jit_override_can_fuse_on_cpu(before[1])
        torch._C._jit_override_can_fuse_on_gpu(before[2])


@pytest.mark.parametrize("values, key", [
    ({"sharp_enabled_group": "dp"}, "dist.sharp_enabled_group"),
    ({"high_priority_stream_groups": ["dpp"]}, "dist.high_priority_stream_groups"),
    ({"distributed_timeout_seconds_after_init": 0}, "dist.distributed_timeout_seconds_after_init"),
])
def test_bad_dist_values_name_the_key(values, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        DistributedInitConfig(**values).finalize()


WEIGHT_HASH_SCRIPT = """
import sys, torch, torch.distributed as dist
from megatron.core import parallel_state
from bridge_hpc.training.train import check_weight_hashes_across_dp_replicas
dist.init_process_group("gloo")
parallel_state.initialize_model_parallel(1, 1)
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Linear(4, 4)
check_weight_hashes_across_dp_replicas([model], 5)  # equal replicas: nothing happens
with torch.no_grad():
    model.bias[0] += rank  # replica 1 drifts
try:
    check_weight_hashes_across_dp_replicas([model], 10)
except RuntimeError as err:
    print(f"rank {rank}: {err}", flush=True)
    sys.exit(0)
sys.exit(3)
"""


def test_replicas_whose_weights_differ_stop_the_run_naming_the_parameters(tmp_path):
    script = tmp_path / "hash.py"
    script.write_text(WEIGHT_HASH_SCRIPT)
    proc = run_ranks([], cwd=str(tmp_path), script=str(script), timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for rank in (0, 1):  # every rank stops, so none waits in the next collective
        assert f"rank {rank}: at iteration 10 the data-parallel replicas' weights differ (1 parameters, e.g. 0:bias)" \
            in proc.stdout
