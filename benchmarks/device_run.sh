#!/bin/bash
# On the GPU machine (repo root, .whl and .device carried): the pinned gRPC wheels and Ray on the
# path, then the given command.   usage: bash benchmarks/device_run.sh CMD...
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
[ -f .device/setup.sh ] && source .device/setup.sh
export PYTHONPATH=$PYTHONPATH:$PWD
exec "$@"   # the command in this process: a timeout's signal reaches it
