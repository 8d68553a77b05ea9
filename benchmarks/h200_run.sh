#!/usr/bin/env bash
# What benchmarks/results/ was made with: the GPU tests, then `spectandem bench`, on the H200
# machine (2 GPUs, so the drafter-on-its-own-GPU rows run too). The image has torch, triton,
# transformers and pytest, and grpcio 1.84 without its health and reflection packages: the gRPC
# tests (test_feature_channel_gpu) need grpcio, grpcio-health-checking and grpcio-reflection 1.85.1
# carried as wheels in .whl/ (`bash benchmarks/device_wheels.sh` fetches them here; name `.whl` in
# the device call's carry), which are installed to a scratch directory first.
#
#   bash benchmarks/h200_run.sh OUT_DIR [tests|check|pending|bench|channel|profile|full8b|all]
#     tests: every GPU test file; check: those of the verify/draft/router fast paths, then profile
#     pending: the rows, batch-invariant, graphs and Triton attention files, then test_split_attention
#     with 480 s
#     channel: that test, then the bench; profile: profile_verify.py and profile_round.py (8B shape)
#     full8b: the 8B-shaped sections of the bench (roofline, transformers, controlled, router8b with
#     the drafter on the second GPU), then profile_round at batch 16
# Test logs go to one file, OUT_DIR/gpu-tests.txt (the device tool returns at most 8 files).
set -uo pipefail
out=${1:?output directory}
what=${2:-all}
mkdir -p "$out"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpus.txt"
run_tests() {   # FILE... : each in its own pytest process, logs appended to gpu-tests.txt
  for f in "$@"; do
    timeout "${TEST_LIMIT:-200}" python3 -m pytest -m gpu "$f" -q -p no:cacheprovider -rf --durations=3 >/tmp/one.txt 2>&1 || true
    { echo "==== $f"; cat /tmp/one.txt; } >>"$out/gpu-tests.txt"
    echo "== $f"; grep -E "passed|failed|error|FAILED" /tmp/one.txt | tail -12
  done
}
if [ "$what" = tests ] || [ "$what" = all ]; then
  run_tests tests/gpu/test_*.py
fi
if [ "$what" = check ]; then
  run_tests tests/gpu/test_rotary_write.py tests/gpu/test_fused_kernels.py tests/gpu/test_gpu_exact.py \
    tests/gpu/test_graphs.py tests/gpu/test_packed_model.py tests/gpu/test_devices_gpu.py \
    tests/gpu/test_router8b_two_gpus.py tests/gpu/test_catchup_graphs.py tests/gpu/test_fused_graph.py \
    tests/gpu/test_triton_attention.py tests/gpu/test_batch_invariant.py
fi
if [ "$what" = pending ]; then
  run_tests tests/gpu/test_rows_attention.py tests/gpu/test_batch_invariant.py tests/gpu/test_graphs.py \
    tests/gpu/test_triton_attention.py
  TEST_LIMIT=480 run_tests tests/gpu/test_split_attention.py
fi
if [ "$what" = channel ]; then
  (timeout 300 python3 -m pytest -q -m gpu -s -p no:cacheprovider tests/gpu/test_feature_channel_gpu.py 2>&1 || true) | tail -30 \
    | tee "$out/feature-channel.txt"
fi
if [ "$what" = bench ] || [ "$what" = all ] || [ "$what" = channel ]; then
  python3 -m spectandem.cli bench --device cuda --batch-sizes 1,4,16,64 --max-tokens 128 \
    --out "$out/bench-h200.json" 2>&1 | tail -80
fi
if [ "$what" = full8b ]; then
  timeout 420 python3 -m spectandem.cli bench --device cuda --sections llama8b,hf8b,controlled,router8b \
    --batch-sizes 1,4,16,64 --acceptance-rates 0.6,0.8,0.9 --router8b-modes sequential,pingpong,auto \
    --router8b-batch-sizes 16,64 --router8b-drafter-device cuda:1 --max-tokens 128 \
    --out "$out/bench-h200x2-8b.json" 2>&1 | grep -v Warn | tail -60
  (cd benchmarks && timeout 150 python3 profile_round.py --workload llama8b --batch 16 --top 25 2>&1 | grep -v Warn) \
    >"$out/profile-round-b16.txt"
  head -9 "$out/profile-round-b16.txt"
fi
if [ "$what" = profile ] || [ "$what" = all ] || [ "$what" = check ]; then
  # (tee into a file, then head: `tee | head` would stop the file where head stops reading)
  (cd benchmarks && python3 profile_verify.py --context 512 --top 12 2>&1 | grep -v Warn) >"$out/profile-verify-h200.txt"
  head -8 "$out/profile-verify-h200.txt"
  (cd benchmarks && python3 profile_round.py --workload llama8b 2>&1 | grep -v Warn) >"$out/profile-round-h200.txt"
  head -10 "$out/profile-round-h200.txt"
fi
