#!/usr/bin/env bash
# One prepared run on a CUDA machine that has PyTorch and Triton but maybe no package index:
#   bash benchmarks/gpu_session.sh [gpu_check.py arguments]      (default: --quick)
# installs the wheels in $WHEELS (default .whl/, e.g. SpikingJelly's and loguru's, fetched elsewhere with
# `pip download --no-deps`), runs the CUDA-marked tests with compiled Triton (those matching $TESTS_K, a
# pytest -k expression, where set), then benchmarks/gpu_check.py.
# Logs, gpu_check.json and gpu_check.md go to $OUT (default benchmarks/results/gpu). Each stage has a time
# limit (TESTS_S, CHECK_S seconds; TESTS_S=0 skips the tests) so that the whole run ends in a known time.
# Relative $OUT and $WHEELS are taken from the current directory. The exit status is the worse of the two
# stages'.
set -u
case "${1:-}" in -h|--help) sed -n '2,10p' "$0" | cut -c3-; exit 0;; esac
repo=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(realpath -m "${OUT:-$repo/benchmarks/results/gpu}")
WHEELS=$(realpath -m "${WHEELS:-$repo/.whl}")
cd "$repo"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu-session-site \
        "$WHEELS"/*.whl || exit 1
    export PYTHONPATH="$PYTHONPATH:/tmp/gpu-session-site"
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/session.log"
start=$(date +%s)
xdist=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 8")
tests_rc=0
if [ "${TESTS_S:-150}" != 0 ]; then
    timeout "${TESTS_S:-150}" "$PY" -m pytest -q -m cuda $xdist -p no:cacheprovider --continue-on-collection-errors \
        ${TESTS_K:+-k "$TESTS_K"} tests > "$OUT/tests.log" 2>&1
    tests_rc=$?
    tail -n 40 "$OUT/tests.log"
    echo "tests: $(( $(date +%s) - start )) s, exit $tests_rc" | tee -a "$OUT/session.log"
fi
args=("$@")
[ $# -eq 0 ] && args=(--quick)
timeout "${CHECK_S:-420}" "$PY" benchmarks/gpu_check.py --out "$OUT" "${args[@]}" > "$OUT/check.log" 2>&1
check_rc=$?
tail -n 80 "$OUT/check.log"
echo "gpu_check: $(( $(date +%s) - start )) s in all, exit $check_rc" | tee -a "$OUT/session.log"
exit $(( tests_rc > check_rc ? tests_rc : check_rc ))
