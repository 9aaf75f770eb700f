#!/usr/bin/env bash
# The GPU checks of issue 22 (and the "on a GPU" items of issues 23-25) as one prepared run, for a session that is
# lent a device machine (../.library/device: 15 minutes of device time in all, starts included, so one call).
#
# The device has torch and most of our dependencies but no registry, no DGL and no ../shared. So:
#
#   bash benchmarks/device_checks.sh prepare
#       here, once, no device time: downloads the wheels the device lacks (pymetis, pydantic and their needs, for
#       its Python 3.12) into .device/wheels and links .device/datasets to ../shared/datasets (.device/ is ignored
#       by git; nothing is copied into the project). Prints the device call to make.
#
#   bash benchmarks/device_checks.sh run
#       on the device (the call `prepare` prints: carry .device/wheels and the two dataset folders through the
#       link, timeout_s 600): installs the wheels into /tmp/site, then runs each check under its own time limit,
#       appending its output to $OUT/log.txt (JSON beside it) and one line per check to $OUT/summary.txt (eight
#       files come back; the device returns at most eight). A check that fails or runs out of time does not stop
#       the ones after it. The limits add up to 570 s.
#
# The checks, in the order the issues ask for them (the session of 2026-11-27 ran the first five on an H200:
# benchmarks/README.md › GPU checks on an H200; these are what it left to check):
#   test_cuda     tests/test_cuda.py: estimate vs max_memory_allocated for every built-in model at K in {1, 4}
#                 and layer-wise (8 chunks per layer), a real OOM recovered with the parameters of a run planned
#                 with the larger K, budget: auto from NVML, the node cache's host->device bytes (issue 22 items 4, 6)
#   anatomy       benchmarks/cuda_peak_anatomy.py --cpp: what is live at the CUDA peak of SAGE pool and GAT, hidden
#                 256, on the 100k-node graph, with C++ stacks (the pool's -6% there is not found yet)
#   estimator     benchmarks/estimator_accuracy.py --device cuda on Cora and CiteSeer, every built-in model but
#                 the LSTM, 2 and 3 layers, hidden 64 and 256, K 1, 4, 8 (issue 22 item 5)
#   estimator_100k  the same on the 100k-node SBM, 2 layers (GAT's out-of-place first sum of dz, modelled without a GPU)
#   estimator_layerwise  the same layer by layer (--layerwise: K METIS chunks per layer), Cora and the 100k graph
#   budget        benchmarks/gpu_budget_epoch.py: products scale at 0.25 x the K = 1 peak under the 6% margin,
#                 then budget: auto beside a process holding half the GPU (item 7)
#   phases        benchmarks/epoch_phases.py --device cuda: epoch time by phase, GPU busy and idle, host->device
#                 bytes and hit rates for K 1, 4, 16, layer-wise, the node caches and macro-batching (item 8)
#   bulk          benchmarks/bulk_sampling.py --device cuda on Coauthor Physics (issue 25 item 1's GPU timing)
#   aggregation   benchmarks/aggregation.py --device cuda: ours against PyG's spmm on torch.sparse (issue 23 item 1)
#   recorded_terms  tests/test_recorded_terms.py's tensor-path estimates (GAT, SAGE mean) under the device's own torch
#                 build (2.11 joined TESTED_TORCH from .ci/torch-2.11's CPU build; the estimator replays recorded terms)
set -u

here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here" || exit 1
wheels=.device/wheels
datasets=.device/datasets

prepare() {
    mkdir -p "$wheels"
    local platforms=()
    for platform in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
                    manylinux2014_x86_64 manylinux1_x86_64; do
        platforms+=(--platform "$platform")
    done
    # What the device image lacks (its package list: ../.library/device/KINDS.md), pinned to the versions this
    # checkout's environment runs, so the device runs what CI tested.
    local python=${PYTHON:-.venv/bin/python}
    local packages=()
    for name in pymetis pydantic pydantic_core annotated_types typing_inspection typing_extensions; do
        packages+=("$name==$("$python" -c "import importlib.metadata as m; print(m.version('$name'))")") || exit 1
    done
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d "$wheels" "${packages[@]}" || exit 1
    if [ ! -e "$datasets" ]; then
        ln -s "$(cd "$here/../shared/datasets" && pwd)" "$datasets" || exit 1
    fi
    du -shL "$wheels" "$datasets/planetoid" "$datasets/graphdata-npz"
    cat <<EOF
Now, with a device lent (status: can_start_another true), make one call:
  run(command="bash benchmarks/device_checks.sh run", timeout_s=600,
      carry=["$wheels", "$datasets/planetoid", "$datasets/graphdata-npz"])
The files come back under the reply's files_at; give_back unless you rerun at once.
EOF
}

check() {  # check NAME SECONDS COMMAND...: run it under a time limit, its output appended to $OUT/log.txt
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    echo "===== $name: $*" >>"$OUT/log.txt"
    timeout "$limit" "$@" >"$OUT/$name.part" 2>&1
    local rc=$?
    cat "$OUT/$name.part" >>"$OUT/log.txt"
    tail -n 15 "$OUT/$name.part"
    rm -f "$OUT/$name.part"
    local verdict=passed
    [ $rc -eq 124 ] && verdict="ran out of its ${limit} s"
    [ $rc -ne 0 ] && [ $rc -ne 124 ] && verdict="failed (rc $rc)"
    echo "$name: $verdict in $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
}

run() {
    : "${OUT:?run on the device machine, which sets OUT (or set it to a folder)}"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$wheels"/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$here PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=6 BETTY_CACHE_DIR=/tmp/betty-cache
    if [ ! -e ../shared/datasets ]; then  # where the tests and benchmarks look (the device has no ../shared)
        mkdir -p ../shared && ln -s "$here/$datasets" ../shared/datasets || exit 1
    fi
    {
        date -u
        nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
        python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
        git log -1 --format='commit %H %s' 2>/dev/null
    } | tee "$OUT/summary.txt"
    check test_cuda 90 python3 -m pytest -q -s -rA -p no:cacheprovider tests/test_cuda.py
    check anatomy 60 python3 benchmarks/cuda_peak_anatomy.py --cpp --models sage-pool,gat --hidden 256 \
        --json "$OUT/anatomy.json"
    check estimator 60 python3 benchmarks/estimator_accuracy.py --device cuda --datasets cora,citeseer \
        --models sage-mean,sage-gcn,sage-pool,gcn,gat --layers 2,3 --hidden 64,256 --ks 1,4,8 \
        --json "$OUT/estimator.json"
    check estimator_100k 30 python3 benchmarks/estimator_accuracy.py --device cuda --datasets synthetic-100k \
        --models sage-mean,sage-gcn,sage-pool,gcn,gat --layers 2 --hidden 64,256 --ks 1,4,8 \
        --json "$OUT/estimator_100k.json"
    check estimator_layerwise 40 python3 benchmarks/estimator_accuracy.py --device cuda --layerwise \
        --datasets cora,synthetic-100k --models sage-mean,sage-pool,gcn,gat --layers 2 --hidden 64,256 --ks 2,8 \
        --json "$OUT/estimator_layerwise.json"
    check budget 100 python3 benchmarks/gpu_budget_epoch.py --fractions 0.25 --auto-fill 0.5 \
        --json "$OUT/gpu_budget_epoch.json"
    check phases 90 python3 benchmarks/epoch_phases.py --device cuda --nodes 200000 --edges 4e6 --epochs 1 \
        --json "$OUT/epoch_phases.json"
    check bulk 30 python3 benchmarks/bulk_sampling.py --device cuda --graph coauthor-physics --batches 32
    check aggregation 40 python3 benchmarks/aggregation.py --device cuda
    check recorded_terms 30 python3 -m pytest -q -p no:cacheprovider tests/test_recorded_terms.py \
        -k "tensor_op_path and (gat or sage-mean)"
}

case "${1:-}" in
    prepare) prepare ;;
    run) run ;;
    *) echo "usage: bash benchmarks/device_checks.sh prepare|run" >&2; exit 2 ;;
esac
