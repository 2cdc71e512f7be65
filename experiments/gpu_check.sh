#!/usr/bin/env bash
# One device session's checks and first measurements of the extended contract, written under $OUT
# (or ./gpu_check_out): the GPU tests of the new paths, the model-shape suite for stages B and C
# against the SDPA backends, and the host latency table. Rerun: OUT=dir experiments/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_check_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > "$out/gpu.txt" 2>&1
$py -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$out/gpu.txt"
timeout ${TEST_S:-240} $py -m pytest -q -n 8 -p no:cacheprovider -m "not slow" ${TESTS:-tests/test_stage_c_shapes.py tests/test_stage_c_backward.py tests/test_shapes.py tests/test_backward.py tests/test_harness_shapes.py} > "$out/tests.log" 2>&1
tail -25 "$out/tests.log"
timeout ${SUITE_S:-240} $py -m harness sweep --suite models --stages ${SUITE_STAGES:-b,c} --out "$out/models" > "$out/suite.log" 2>&1
tail -40 "$out/suite.log"
timeout 60 $py -m harness latency --out "$out/latency.csv" > "$out/latency.log" 2>&1
tail -15 "$out/latency.log"
