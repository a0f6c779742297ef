#!/usr/bin/env bash
# The check of a lent GPU machine, in one call of a few minutes (docs/bench/gpu-*.md hold its
# results and times): attnkit installed from this tree with no network and no dependency change,
# the GPU tests (`make test-gpu`), then a short `attnkit bench --device cuda`. Everything it prints goes to
# $OUT/log.txt; $OUT/summary.json holds the tests' counts and where the bench's results are, and
# $OUT/tests.xml each test's outcome and time.
#   usage: OUT=/some/folder scripts/gpu-check.sh   (OUT defaults to ./gpu-check)
set -uo pipefail
OUT=${OUT:-gpu-check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor}
began=$(date +%s)
stage() { echo; echo "== $1 ($(( $(date +%s) - began )) s)"; }

stage "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
$PY -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name())'

stage "install"  # editable, without its dependencies: nothing is fetched, nothing else changes
if $PY -m pip install --quiet --no-deps --no-index --no-build-isolation -e . 2>&1 | tail -3; then
  $PY -c 'import attnkit; print("attnkit", attnkit.__version__, "from", attnkit.__file__)'
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}  # the tree's code either way

# pytest-timeout, where it is installed, ends a test that hangs so that the others still report
timeout_option() { $PY -c 'import pytest_timeout' 2>/dev/null && echo "--timeout=150"; }

stage "tests"
# (on a bare machine the tests first compile torch's kernels into empty caches, which takes
# longest: docs/bench/gpu-h100.md; TEST_SECONDS shortens or lengthens the stage)
# (an interrupt at the limit, as Ctrl-C would: pytest then still writes the report of what ran)
rm -f "$OUT/tests.xml"
timeout -s INT -k 30 "${TEST_SECONDS:-300}" make --no-print-directory test-gpu PYTHON="$PY" \
  PYTEST_ARGS="--junitxml=$OUT/tests.xml -q -rfE --tb=short $(timeout_option)"
tests_rc=$?

stage "bench: plain attention, bf16, b=4 h=16 d=128"
timeout "${KERNEL_SECONDS:-60}" $PY -m attnkit.cli bench --device cuda --impls torch-sdpa attnkit-auto --out "$OUT/kernels"
stage "bench: score_mod, document mask and sinks, N=8192, forward+backward"
timeout "${MODS_SECONDS:-100}" $PY -m attnkit.cli bench --device cuda --variants relbias document sinks --n 8192 \
  --modes fwd+bwd --causal yes --out "$OUT/mods"
stage "bench: one decoding step over a 32k bf16 cache"
timeout "${DECODE_SECONDS:-30}" $PY -m attnkit.cli bench --device cuda --decode --out "$OUT/decode"
stage "plain attention: attnkit's time around SDPA, and the NaN rule's pieces"
timeout 60 $PY scripts/gpu-overhead.py
stage "where attnkit's time goes around torch's kernels (torch.profiler)"
timeout 60 $PY scripts/gpu-profile.py
rm -f "$OUT"/*/*.png  # what comes back is the tables and their JSON

stage "summary"
$PY - "$OUT" "$tests_rc" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path

out, rc = Path(sys.argv[1]), int(sys.argv[2])
summary = {"tests_rc": rc}
try:
    suite = ET.parse(out / "tests.xml").getroot().find("testsuite")
    summary["tests"] = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    summary["tests"]["seconds"] = float(suite.get("time", 0))
except (OSError, ET.ParseError, AttributeError) as err:
    summary["tests"] = f"no report: {err}"
summary["bench"] = sorted(str(p.relative_to(out)) for p in out.glob("*/*.json"))
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary))
EOF
echo "done in $(( $(date +%s) - began )) s"
exit "$tests_rc"
