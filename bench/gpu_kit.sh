#!/bin/sh
# What one GPU call carries, made here where PyPI and Debian are reachable (the GPU machine reaches
# nothing): the wheels its image lacks, for its Python 3.12 (.whl/), Stockfish's .deb and the
# baseline checkout bench/gpu_check.py's first section compares with (.gpu/). Both folders are
# ignored by git, so they travel only when the call's `carry` names them. Everything that travels
# (the working tree too) must stay under the device tool's 64 MiB: this prints the total.
#
#     sh bench/gpu_kit.sh               # then, on the GPU machine, from the repository's root:
#     sh bench/gpu_kit.sh --command     # the command to run there: carry .whl and .gpu,
#                                       # timeout_s 600; results.json, its log, logs.tgz come back
#
# The image there has torch, accelerate, peft, tokenizers and the datasets' heavy dependencies; it
# lacked python-chess, TRL and datasets, and had transformers 5.17 (we pin 5.23: carried).
set -eu
cd "$(dirname "$0")/.."
BASE=c2eee3e   # the last commit whose main job took 0.31 s a step on an H200

if [ "${1:-}" = "--command" ]; then
    cat <<'EOF' | tr '\n' ' ' && echo
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site
.whl/*.whl && export PYTHONPATH=/tmp/site && dpkg -x .gpu/stockfish*.deb /tmp/sf
&& export PATH=/tmp/sf/usr/games:$PATH
&& cp models/rook-tiny/model.safetensors .gpu/base/models/rook-tiny/
&& PYTHONUNBUFFERED=1 timeout 560 python3 bench/gpu_check.py --budget 540 --baseline .gpu/base
--out /tmp/check 2>&1 | tee $OUT/gpu_check.log; cp /tmp/check/results.json $OUT/;
tar -czf $OUT/logs.tgz -C /tmp/check --exclude='*.safetensors' --exclude='*.pt'
--exclude='*.pickle' .
EOF
    exit 0
fi

rm -rf .whl .gpu
mkdir -p .whl .gpu/base
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl \
    transformers==5.23.0 trl==1.16.0 datasets==5.2.0 "dill<0.4.2" "multiprocess<0.70.20"
python3 -m pip wheel -q --no-deps chess==1.11.2 -w .whl   # pure Python: built here, any machine
(cd .gpu && apt-get download stockfish)
# the baseline without what it shares with HEAD: the model (the same file; the command copies it
# back), its tests and pictures
git archive "$BASE" | tar -x -C .gpu/base
if [ "$(git rev-parse "$BASE:models/rook-tiny/model.safetensors")" != \
     "$(git rev-parse HEAD:models/rook-tiny/model.safetensors)" ]; then
    echo "models/rook-tiny differs from $BASE's: carry the baseline's model too" >&2
    exit 1
fi
rm -rf .gpu/base/models/rook-tiny/model.safetensors .gpu/base/tests .gpu/base/docs
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
kit=$(du -cb .whl .gpu | tail -1 | cut -f1)
echo "kit $((kit / 1048576)) MiB + tracked tree $((tree / 1048576)) MiB" \
     "= $(((kit + tree) / 1048576)) MiB of the 64 that may travel (untracked files count too)"
