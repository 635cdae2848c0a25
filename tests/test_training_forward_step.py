"""Forward-step signatures (Bridge's injection rules), loss patterns and their reduction.

Single-rank tests run in this process (gloo, world size 1); one test launches this file under
torchrun with 2 ranks to check the data-parallel reduction and a 2-rank training run.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import sys
from functools import partial

import pytest
import torch
from bridge_test_helpers import TINY, free_port, single_rank_world
from warm_ranks import run_ranks

from bridge_hpc.training.engine.collectives import reduce_loss_dicts
from bridge_hpc.training.state import GlobalState
from bridge_hpc.training.utils.train_utils import needs_global_state_injection, prepare_forward_step_func

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------------------------
# Forward-step functions of every supported shape
# ---------------------------------------------------------------------------------------------

CALLS: list = []


def _gpt_step(data_iterator, model):
    from bridge_hpc.training.engine.model import get_batch, masked_next_token_loss

    batch = get_batch(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(masked_next_token_loss, batch["loss_mask"])


def fs_two(data_iterator, model):
    CALLS.append(("two", None))
    return _gpt_step(data_iterator, model)


def fs_three_plan(data_iterator, model, return_schedule_plan=False):
    CALLS.append(("three_plan", return_schedule_plan))
    return _gpt_step(data_iterator, model)


def fs_three_hint(st: GlobalState, data_iterator, model):
    CALLS.append(("three_hint", st.train_state.step))
    return _gpt_step(data_iterator, model)


def fs_four(state: GlobalState, data_iterator, model, return_schedule_plan: bool = False):
    CALLS.append(("four", state.train_state.step))
    return _gpt_step(data_iterator, model)


def fs_by_name(state, data_iterator, model):
    CALLS.append(("by_name", state.train_state.step))
    return _gpt_step(data_iterator, model)


def fs_by_global_name(global_state, data_iterator, model):
    CALLS.append(("by_global_name", global_state.train_state.step))
    return _gpt_step(data_iterator, model)


def fs_string_hint(s: "GlobalState", data_iterator, model):
    CALLS.append(("string_hint", s.train_state.step))
    return _gpt_step(data_iterator, model)


class StatefulFunctor:
    """A functor with state of its own, taking the GlobalState too."""

    def __init__(self):
        self.calls = 0

    def __call__(self, state: GlobalState, data_iterator, model, return_schedule_plan=False):
        self.calls += 1
        CALLS.append(("functor", state.train_state.step))
        return _gpt_step(data_iterator, model)


class PlainFunctor:
    def __init__(self):
        self.calls = 0

    def __call__(self, data_iterator, model):
        self.calls += 1
        return _gpt_step(data_iterator, model)


@pytest.mark.parametrize("func,expected", [
    (fs_two, False), (fs_three_plan, False), (fs_three_hint, True), (fs_four, True), (fs_by_name, True),
    (fs_by_global_name, True), (fs_string_hint, True), (StatefulFunctor(), True), (PlainFunctor(), False),
    (lambda data_iterator, state, model: None, False),  # 'state' not first and no hint: no injection
])
def test_injection_detection(func, expected):
    assert needs_global_state_injection(func) is expected


def test_functor_wrapped_once_keeps_its_state():
    state, functor = GlobalState(), StatefulFunctor()
    wrapped = prepare_forward_step_func(functor, state)
    assert isinstance(wrapped, partial) and wrapped.func is functor and wrapped.args == (state,)
    assert prepare_forward_step_func(fs_two, state) is fs_two


def test_maybe_inject_state_follows_the_signature_unless_told():
    from bridge_hpc.training.utils.train_utils import maybe_inject_state

    state = GlobalState()
    injected = maybe_inject_state(fs_four, state)
    assert isinstance(injected, partial) and injected.func is fs_four and injected.args[0] is state
    assert maybe_inject_state(fs_three_plan, state) is fs_three_plan  # (data_iterator, model, plan): none
    # needs_injection, when given, is taken as is (prepare_forward_step_func inspects once, then passes it)
    assert maybe_inject_state(fs_four, state, needs_injection=False) is fs_four
    forced = maybe_inject_state(fs_two, state, needs_injection=True)
    assert forced.func is fs_two and forced.args == (state,)
    # A reference, not a copy: the step counter the forward step reads moves with the run.
    state.train_state.step = 7
    CALLS.clear()
    with pytest.raises(TypeError):
        injected(None, None)  # no data (next(None)): the call fails after the state was passed in
    assert CALLS == [("four", 7)]


def test_forward_step_callable_is_the_union_of_the_four_signatures_and_functors():
    import typing

    from bridge_hpc.training import forward_step_func_types as types
    from bridge_hpc.training.pretrain import pretrain
    from bridge_hpc.training.train import train, train_step

    members = set(typing.get_args(types.ForwardStepCallable))
    assert members == {types.TwoArgForwardStep, types.ThreeArgStateForwardStep, types.ThreeArgForwardStep,
                       types.FourArgForwardStep, types.ForwardStepFunctor}
    for protocol, params in [(types.TwoArgForwardStep, ["data_iterator", "model"]),
                             (types.ThreeArgStateForwardStep, ["state", "data_iterator", "model"]),
                             (types.ThreeArgForwardStep, ["data_iterator", "model", "return_schedule_plan"]),
                             (types.FourArgForwardStep, ["state", "data_iterator", "model", "return_schedule_plan"])]:
        assert list(inspect.signature(protocol.__call__).parameters)[1:] == params, protocol
    # What the entry points accept: each takes the forward step as Bridge names it.
    for func in (pretrain, train, train_step):
        assert "forward_step_func" in inspect.signature(func).parameters, func


# ---------------------------------------------------------------------------------------------
# In-process, world size 1
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def single_rank():
    yield from single_rank_world()


def _tiny_config(tmp_path, *overrides):
    from bridge_hpc.rank import build_config

    job = tmp_path / "job.toml"
    shutil.copy(TINY, job)
    return build_config(str(job), [f"job.run_dir={tmp_path / 'runs' / 'tiny'}", "train.train_iters=2",
                                   "train.global_batch_size=4", "train.eval_interval=1", "train.eval_iters=1",
                                   "checkpoint.save_interval=2", "scheduler.lr_warmup_iters=1", *overrides])


@pytest.mark.parametrize("make", [
    lambda: fs_two, lambda: fs_three_plan, lambda: fs_three_hint, lambda: fs_four, lambda: fs_by_name,
    lambda: fs_by_global_name, lambda: fs_string_hint, StatefulFunctor, PlainFunctor,
], ids=["two", "three_plan", "three_hint", "four", "by_name", "by_global_name", "string_hint", "functor",
        "plain_functor"])
def test_every_signature_trains(single_rank, tmp_path, make):
    from bridge_hpc.training.engine.metrics import read_metrics
    from bridge_hpc.training.pretrain import pretrain

    cfg = _tiny_config(tmp_path)
    func = make()
    CALLS.clear()
    pretrain(cfg, func)
    records = read_metrics(cfg.logger.metrics_file)
    assert sorted(records) == [1, 2] and all(r["loss"] > 0 for r in records.values())
    # 2 steps x 2 micro-batches, plus 1 eval iteration x 2 micro-batches after each step
    if hasattr(func, "calls"):
        assert func.calls == 8
    else:
        assert len(CALLS) == 8
        assert all(value in (None, False, 0, 1, 2) for _, value in CALLS)
    if CALLS and CALLS[0][1] is not None and CALLS[0][0] != "three_plan":
        # state injected by reference: the forward step sees the live step counter
        assert [v for _, v in CALLS[:2]] == [0, 0] and [v for _, v in CALLS[2:4]] == [1, 1]
    assert os.path.isdir(os.path.join(cfg.checkpoint.save, "iter_0000002"))


# ---------------------------------------------------------------------------------------------
# Loss patterns against a hand computation
# ---------------------------------------------------------------------------------------------


class Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return self.w * x


def _toy(single_rank_fixture=None):
    from bridge_hpc.training.pretrain import TorchOptimizer

    model = Scale()
    opt = TorchOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), list(model.parameters()), clip_grad=0.0)
    return model, opt


MICRO = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 5.0]), torch.tensor([6.0])]


def test_loss_pattern_standard(single_rank):
    from bridge_hpc.training.train import forward_backward

    model, opt = _toy()

    def step(data_iterator, model):
        x = next(data_iterator)
        out = model(x)
        return out, lambda o: (o.mean(), {"loss": o.mean().detach()})

    reports = forward_backward(step, iter(MICRO), [model], 3, optimizer=opt)
    reduced = reduce_loss_dicts(reports)
    means = [2.0 * x.mean() for x in MICRO]
    assert torch.allclose(reduced["loss"], sum(means) / 3)
    # d/dw of (1/3) sum_i mean(w x_i) = (1/3) sum_i mean(x_i)
    assert torch.allclose(model.w.grad, sum(x.mean() for x in MICRO) / 3)


def test_loss_pattern_token_aware(single_rank):
    from bridge_hpc.training.train import forward_backward

    model, opt = _toy()

    def step(data_iterator, model):
        x = next(data_iterator)
        out = model(x)

        def loss_func(o):
            total, n = o.sum(), torch.tensor(o.numel(), dtype=torch.int)
            return total, n, {"lm loss": torch.cat([total.detach().view(1), n.float().view(1)])}

        return out, loss_func

    reports = forward_backward(step, iter(MICRO), [model], 3, optimizer=opt)
    reduced = reduce_loss_dicts(reports)
    all_tokens = torch.cat(MICRO)
    assert torch.allclose(reduced["lm loss"], 2.0 * all_tokens.sum() / all_tokens.numel())  # per-token mean
    # gradient: (1/3) sum_i sum(x_i)/n_i
    assert torch.allclose(model.w.grad, sum(x.sum() / x.numel() for x in MICRO) / 3)


def test_inference_pattern(single_rank):
    from bridge_hpc.training.train import forward_backward

    model, _ = _toy()

    def step(data_iterator, model):
        x = next(data_iterator)
        out = model(x)

        def loss_func(o, non_loss_data=False):
            assert non_loss_data
            return {"argmax": int(o.argmax()), "values": o.tolist()}

        return out, loss_func

    collected = forward_backward(step, iter(MICRO), [model], 3, forward_only=True, collect_non_loss_data=True)
    assert collected == [{"argmax": 2, "values": [2.0, 4.0, 6.0]}, {"argmax": 1, "values": [8.0, 10.0]},
                         {"argmax": 0, "values": [12.0]}]
    assert model.w.grad is None


def test_train_step_returns_bridge_tuple(single_rank, tmp_path):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from bridge_hpc.training.train import train_step

    state = GlobalState()
    state.cfg = _tiny_config(tmp_path, "train.global_batch_size=6", "train.micro_batch_size=2")
    state.cfg.validate(world_size=1)
    model, opt = _toy()
    sched = OptimizerParamScheduler(opt, 0.0, 0.1, 0.0, 0, 10, "constant", 0.0, 0.0, 10, "constant")

    def step(data_iterator, model):
        out = model(next(data_iterator))
        return out, lambda o: (o.mean(), {"loss": o.mean().detach()})

    result = train_step(step, iter(MICRO), [model], opt, sched, state)
    loss_dict, skipped, should_checkpoint, should_exit, exit_code, grad_norm, num_zeros = result
    assert len(result) == 7 and skipped == 0 and not should_checkpoint and not should_exit and exit_code == 0
    expected_grad = float(sum(x.mean() for x in MICRO) / 3)
    assert grad_norm == pytest.approx(abs(expected_grad))
    assert float(model.w) == pytest.approx(2.0 - 0.1 * expected_grad)
    assert float(loss_dict["loss"]) == pytest.approx(float(sum(2.0 * x.mean() for x in MICRO) / 3))


# ---------------------------------------------------------------------------------------------
# Two ranks: data-parallel reduction and a 2-rank run with an injected functor
# ---------------------------------------------------------------------------------------------


def test_two_ranks(tmp_path):
    job = tmp_path / "job.toml"
    shutil.copy(TINY, job)
    proc = run_ranks([str(job)], cwd=os.path.dirname(str(job)), script=os.path.abspath(__file__), timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for rank in (0, 1):
        assert json.loads((tmp_path / f"ok_{rank}.json").read_text())["calls"] == 12


def _two_rank_worker(job: str) -> None:
    """Run under torchrun: each rank reports different losses; check the reduction by hand."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from bridge_hpc.rank import build_config
    from bridge_hpc.training.pretrain import initialize_distributed, pretrain

    initialize_distributed()
    rank = dist.get_rank()
    parallel_state.initialize_model_parallel(1, 1)

    # token-aware: rank r reports microbatches [sum, n]; result = all sums / all tokens
    per_rank = {0: [(3.0, 2), (5.0, 3)], 1: [(7.0, 1), (11.0, 4)]}
    reports = [{"lm loss": torch.tensor([s, float(n)])} for s, n in per_rank[rank]]
    got = reduce_loss_dicts(reports)["lm loss"]
    assert torch.allclose(got, torch.tensor((3 + 5 + 7 + 11) / (2 + 3 + 1 + 4))), got
    # standard: mean over microbatches, then over ranks
    per_rank_std = {0: [1.0, 2.0], 1: [4.0, 8.0]}
    got = reduce_loss_dicts([{"loss": torch.tensor(v)} for v in per_rank_std[rank]])["loss"]
    assert torch.allclose(got, torch.tensor(((1 + 2) / 2 + (4 + 8) / 2) / 2)), got

    cfg = build_config(job, ["train.train_iters=3", "train.eval_interval=0", "checkpoint.save_interval=3",
                             "scheduler.lr_warmup_iters=1"])
    functor = StatefulFunctor()
    pretrain(cfg, functor)
    # 3 steps x (8 samples / (2 per micro-batch x 2 ranks)) micro-batches
    assert functor.calls == 6, functor.calls
    with open(os.path.join(os.path.dirname(job), f"ok_{rank}.json"), "w") as f:
        json.dump({"calls": functor.calls * 2}, f)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    _two_rank_worker(sys.argv[1])


# ---------------------------------------------------------------------------------------------
# The step's one collective: losses and the ranks' stop observations together (2 gloo ranks)
# ---------------------------------------------------------------------------------------------


def _two_rank_reduce(rank: int, port: int, out_dir: str) -> None:
    import json

    import torch.distributed as dist

    from bridge_hpc.training.engine.collectives import reduce_loss_dicts, reduce_loss_dicts_and_flags

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    calls = []
    real = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_reduce = counting
    # rank 0: per-token sums 3 and 5 over 2 + 2 tokens, mean report 1.0 and 3.0; rank 1: 7 over 4, 5.0 and 7.0
    per_token = [[3.0, 2.0], [5.0, 2.0]] if rank == 0 else [[7.0, 4.0], [0.0, 0.0]]
    means = [1.0, 3.0] if rank == 0 else [5.0, 7.0]
    reports = [{"lm loss": torch.tensor(p), "aux": torch.tensor([m])} for p, m in zip(per_token, means)]
    flags = {"signal received": rank == 1, "time limit": False, "exit_duration_in_mins": rank == 0}
    reduced, agreed = reduce_loss_dicts_and_flags(reports, None, flags)
    plain = {k: float(v) for k, v in reduce_loss_dicts(reports, None).items()}
    # As under tensor or pipeline parallelism: each rank its own data-parallel group (size 1), so the
    # losses stay the rank's own while the stop observations are still agreed by the whole world.
    own = [dist.new_group([r]) for r in range(2)][rank]
    collectives = len(calls)
    del calls[:]
    mp_reduced, mp_agreed = reduce_loss_dicts_and_flags(reports, own, flags)
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump({"reduced": {k: float(v) for k, v in reduced.items()}, "agreed": agreed,
                   "collectives": collectives, "plain": plain,
                   "mp": {"reduced": {k: float(v) for k, v in mp_reduced.items()}, "agreed": mp_agreed,
                          "collectives": len(calls)}}, f)
    # No destroy_process_group: the rank leaves through os._exit (run_gloo_ranks), as the toolkit's ranks do.


def test_losses_and_stop_observations_are_agreed_in_one_all_reduce(tmp_path):
    import json

    from bridge_test_helpers import run_gloo_ranks

    run_gloo_ranks(_two_rank_reduce, free_port(), str(tmp_path))
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    for r in results:
        # per-token: (3 + 5 + 7 + 0) / (2 + 2 + 4 + 0) = 15 / 8; mean: ((1+3)/2 + (5+7)/2) / 2 = 4
        assert r["reduced"] == {"aux": 4.0, "lm loss": 15.0 / 8.0}
        assert r["plain"] == r["reduced"]  # reduce_loss_dicts is the same computation without flags
        assert r["agreed"] == {"signal received": True, "time limit": False, "exit_duration_in_mins": True}
        assert r["collectives"] == 2  # one with the flags, one for reduce_loss_dicts alone
    # data-parallel groups of one rank each: no loss all-reduce; the flags in one all-reduce of the world
    assert results[0]["mp"]["reduced"] == {"aux": 2.0, "lm loss": 2.0}  # (1+3)/2; (3+5)/(2+2)
    assert results[1]["mp"]["reduced"] == {"aux": 6.0, "lm loss": 1.75}  # (5+7)/2; 7/4
    for r in results:
        assert r["mp"]["agreed"] == {"signal received": True, "time limit": False, "exit_duration_in_mins": True}
        assert r["mp"]["collectives"] == 1
