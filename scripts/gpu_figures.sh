#!/usr/bin/env bash
# The README's one-GPU figures and the GPU tests (tests/test_gpu_*.py), in one go, on a machine with
# one CUDA GPU and the package installed (pip install -e '.[train,test,data]'):
#
#   bash scripts/gpu_figures.sh OUTDIR [STEP ...]
#
# STEPs, in this order by default: tests checkpoint preemption loop graph optimizer data; and, not in the
# default list: tests-te (the GPU tests again, every rank on Transformer Engine's layers: needs TE),
# preemption-new-node (the same with the checkpoints out of the page cache at each
# restart), kernels (where a step's device time goes: loop_overhead.py --kernels, the bare and the
# bridge loop), peft (benchmarks/peft.py: LoRA against full fine-tuning), hf (benchmarks/hf_import.py
# --gpu: a fine-tune's start from a Hugging Face folder against a megatron-core checkpoint) and, on a
# machine with 2 GPUs, parallel (benchmarks/parallel.py). Each writes its
# log (and its benchmark's JSON) into OUTDIR and has its own time limit, so that one step that hangs
# does not take the others with it; the last lines of each log are printed as it ends.
set -uo pipefail
out=${1:?usage: bash scripts/gpu_figures.sh OUTDIR [tests|tests-te|checkpoint|preemption|preemption-new-node|loop|graph|optimizer|data|peft|hf|parallel|kernels ...]}
shift
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(tests checkpoint preemption loop graph optimizer data)
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."

run() {  # run NAME SECONDS COMMAND...
    local name=$1 limit=$2 rc
    shift 2
    echo "== $name: $*"
    # SIGINT first: pytest then still prints its summary (which test failed) before it stops
    timeout -s INT -k 30 "$limit" "$@" > "$out/$name.log" 2>&1
    rc=$?
    echo "== $name: exit status $rc ($out/$name.log)"
    tail -n 25 "$out/$name.log"
}

for step in "${steps[@]}"; do
    case $step in
        tests) run tests 900 python -m pytest -q -p no:warnings tests/test_gpu_*.py ;;
        tests-te) run tests-te 900 python -m pytest -q -p no:warnings --layers=transformer_engine tests/test_gpu_*.py ;;
        checkpoint) run checkpoint 900 python benchmarks/checkpoint.py --device cuda --out "$out/checkpoint.json" ;;
        preemption) run preemption 900 python benchmarks/preemption.py --device cuda --json "$out/preemption.json" ;;
        preemption-new-node) run preemption-new-node 900 python benchmarks/preemption.py --device cuda --new-node \
                                 --json "$out/preemption_new_node.json" ;;
        loop) run loop 900 python benchmarks/loop_overhead.py --device cuda --json "$out/loop_overhead.json" ;;
        graph) run graph 600 python benchmarks/loop_overhead.py --device cuda --fused --cuda-graph --loops bare,bridge \
                   --repeat 2 --json "$out/loop_overhead_graph.json" ;;
        optimizer) run optimizer 600 python benchmarks/optimizer_step.py --json "$out/optimizer_step.json" ;;
        data) run data 900 python benchmarks/prepare_data.py --part 3 --json "$out/prepare_data_gpu.json" ;;
        peft) run peft 900 python benchmarks/peft.py --json "$out/peft.json" ;;
        hf) run hf 900 python benchmarks/hf_import.py --gpu --repeats 2 --json "$out/hf_import.json" ;;
        parallel) run parallel 900 python benchmarks/parallel.py --json "$out/parallel.json" ;;
        kernels) run kernels 600 python benchmarks/loop_overhead.py --device cuda --loops bare,bridge --repeat 1 \
                     --kernels --json "$out/kernels/loop_overhead.json" ;;
        *) echo "gpu_figures.sh: unknown step '$step' (tests, checkpoint, preemption, preemption-new-node, loop, graph, optimizer, data, peft, hf, parallel, kernels)" >&2
           exit 2 ;;
    esac
done
