#!/usr/bin/env bash
# What benchmarks/results/ was made with: the GPU tests, then `spectandem bench`, on the H200
# machine (2 GPUs, so the drafter-on-its-own-GPU rows run too). The image has torch, triton and
# transformers but no pytest: wheels carried in .whl/ are installed to a scratch directory.
#
#   bash benchmarks/h200_run.sh OUT_DIR [tests|bench|channel|profile|all]
#     channel: that test, then the bench; profile: profile_verify.py and profile_round.py (8B shape)
set -uo pipefail
out=${1:?output directory}
what=${2:-all}
mkdir -p "$out"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PWD:/tmp/site
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpus.txt"
if [ "$what" = tests ] || [ "$what" = all ]; then
  for f in tests/gpu/test_*.py; do
    name=$(basename "$f" .py)
    timeout 400 python3 -m pytest -m gpu "$f" -q -p no:cacheprovider -rf --durations=5 >"$out/$name.txt" 2>&1 || true
    echo "== $f"; grep -E "passed|failed|error|FAILED" "$out/$name.txt" | tail -12
  done
fi
if [ "$what" = channel ]; then
  (timeout 300 python3 -m pytest -q -m gpu -s -p no:cacheprovider tests/gpu/test_feature_channel_gpu.py 2>&1 || true) | tail -30 \
    | tee "$out/feature-channel.txt"
fi
if [ "$what" = bench ] || [ "$what" = all ] || [ "$what" = channel ]; then
  python3 -m spectandem.cli bench --device cuda --batch-sizes 1,4,16,64 --max-tokens 128 \
    --out "$out/bench-h200.json" 2>&1 | tail -80
fi
if [ "$what" = profile ] || [ "$what" = all ]; then
  (cd benchmarks && python3 profile_verify.py --context 512 --top 12 2>&1 | grep -v Warn) | tee "$out/profile-verify-h200.txt" | head -8
  (cd benchmarks && python3 profile_round.py --workload llama8b 2>&1 | grep -v Warn) | tee "$out/profile-round-h200.txt" | head -10
fi
