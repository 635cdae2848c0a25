"""``bridge-hf`` on a GPU node (issue 35); skipped without CUDA.

On a machine with a CUDA GPU the tools build the model on the GPU, where megatron-core's layers draw
their initial weights from its model-parallel CUDA RNG tracker: ``bridge-hf import`` crashed there
("cuda rng state model-parallel-rng is not added") until the tools seeded it as a rank does. The CPU
tests cannot see this. Here, for every family:

* ``bridge-hf import`` then ``bridge-hf export`` through the command line, CUDA visible: exit 0, and the
  exported tensors are the original ones bit for bit (so transformers gives the same logits);
* the toolkit's GPT built on the GPU from the folder gives transformers' logits (fp32, TP1), on the local
  layers and on Transformer Engine's (where the package is; within TF32's tolerance there: TE's fp32
  GEMMs are TF32, see :data:`TF32_MARGIN`).

Run: ``python -m pytest -q tests/test_gpu_hf.py`` (about a minute on an H100).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys

import pytest
import torch
from bridge_test_helpers import direct_rank_env, single_rank_world
from hf_models import FAMILIES, VOCAB, batch, hf_logits, make_hf_model, model_config, safetensors_in

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

#: fp32 on the GPU (cuDNN/flash attention kernels against transformers' eager attention on the CPU).
GPU_TOLERANCE = 1e-3


_tensors = safetensors_in


def _bridge_hf(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bridge_hpc.cli.hf", *args], capture_output=True, text=True,
                          env=direct_rank_env(), timeout=300)


@pytest.mark.parametrize("family", FAMILIES)
def test_import_and_export_through_the_cli_on_a_gpu_node(tmp_path, family):
    original, imported, exported = str(tmp_path / "hf"), str(tmp_path / "ckpt"), str(tmp_path / "out")
    make_hf_model(family, original)
    for args in (("import", original, imported), ("export", imported, exported)):
        done = _bridge_hf(*args)
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-4000:]
    before, after = _tensors(original), _tensors(exported)
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name


@pytest.fixture
def gpu_world():
    yield from single_rank_world("nccl")


LAYERS = ["local", pytest.param("transformer_engine", marks=pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is None, reason="needs Transformer Engine"))]


def _gpt_logits(folder: str, layers: str, tf32: bool = False) -> torch.Tensor:
    """The toolkit's GPT on the GPU from ``folder`` (``layers``), its fp32 logits on :func:`batch`; with
    ``tf32`` torch's own matrix multiplies run in TF32 (``torch.backends.cuda.matmul.allow_tf32``)."""
    from bridge_hpc.models.hf.convert import TOOL_SEED
    from bridge_hpc.training.engine.model import gpt_model_provider
    from bridge_hpc.training.hf import load
    from bridge_hpc.training.pretrain import set_random_seed

    set_random_seed(TOOL_SEED)  # as a rank and the tools do: the GPU layers' init reads the CUDA RNG tracker
    model = gpt_model_provider(dataclasses.replace(model_config(folder), transformer_impl=layers)).eval()
    assert (type(model.decoder.layers[0].self_attention.linear_qkv).__name__ == "TELayerNormColumnParallelLinear") \
        == (layers == "transformer_engine")
    assert next(model.parameters()).is_cuda
    load.load_hf_weights(folder, [model])
    b = {k: v.cuda() for k, v in batch().items()}
    was = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        with torch.no_grad():
            return model(b["tokens"], b["position_ids"], None)[..., :VOCAB].float().cpu()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = was


#: Transformer Engine runs every fp32 matrix multiply in TF32 (its cuBLASLt GEMM's compute type is
#: ``CUBLAS_COMPUTE_32F_FAST_TF32`` for all but FP8 inputs; no setting turns that off), so its fp32 logits
#: cannot come within :data:`GPU_TOLERANCE`, which is fp32's. Its tolerance is TF32's own: the distance of
#: the local layers from transformers when torch's GEMMs run in TF32 too, measured in the same test, times
#: this margin (two roundings of the same kind never land exactly alike). A wrong mapping is off by O(1).
TF32_MARGIN = 2.0


@pytest.mark.parametrize("layers", LAYERS)
@pytest.mark.parametrize("family", FAMILIES)
def test_the_gpt_built_on_the_gpu_gives_transformers_logits(tmp_path, gpu_world, family, layers):
    folder = str(tmp_path / family)
    make_hf_model(family, folder)
    ours = _gpt_logits(folder, layers)
    theirs = hf_logits(folder, batch()["tokens"])
    distance = (ours - theirs).abs().max().item()
    tolerance = GPU_TOLERANCE
    if layers == "transformer_engine":
        tf32_distance = (_gpt_logits(folder, "local", tf32=True) - theirs).abs().max().item()
        tolerance = max(GPU_TOLERANCE, TF32_MARGIN * tf32_distance)
        print(f"[{family}] TE layers {distance:.2e} from transformers' logits; local layers in TF32 "
              f"{tf32_distance:.2e}; tolerance {tolerance:.2e}")
    assert distance <= tolerance, f"{layers}: {distance:.3e} from transformers' logits (tolerance {tolerance:.1e})"
    # The top token agrees wherever transformers' top two are further apart than the tolerance allows.
    top2 = theirs.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * tolerance
    assert clear.float().mean().item() > 0.5  # the comparison below covers most positions
    assert torch.equal(ours.argmax(-1)[clear], theirs.argmax(-1)[clear])
