#!/usr/bin/env bash
# Fetches, here, the Python wheels the GPU image lacks for the gRPC tests (the image has grpcio
# 1.84 and neither grpcio-health-checking nor grpcio-reflection; the generated stubs need 1.85.1),
# for Python 3.12 on x86-64, into .whl/ (git-ignored). benchmarks/h200_run.sh installs whatever
# .whl/ holds into a scratch directory before its runs; name `.whl` in the device call's carry.
#
#   bash benchmarks/device_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
version=1.85.1
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "grpcio==$version"
# The two service packages are pure Python.
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl \
  "grpcio-health-checking==$version" "grpcio-reflection==$version"
ls -l .whl
