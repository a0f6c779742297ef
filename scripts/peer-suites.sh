#!/usr/bin/env bash
# attnkit's drop-ins held to the peers' own test suites (issue 43): PyTorch's tests of
# nn.MultiheadAttention and of its transformer layers, and transformers' model tests, each run once
# as they are (the baseline) and once per substitution, with a pytest plugin of
# scripts/peer_plugins/ that makes the substitution at start-up and counts the calls of attnkit's
# stand-in (a run that never calls it fails). The record is docs/bench/peer-suites.md.
#
#   usage: scripts/peer-suites.sh PEERS [SUITE...]
#     PEERS   a folder holding the peers' checkouts:
#             PEERS/pytorch       PyTorch's repository at the pinned torch's tag (test/ is enough)
#             PEERS/transformers  transformers' repository at the pinned version's tag
#     SUITE   torch, llama, mistral, qwen2, gemma2, gpt_oss, qwen3_next, qwen3_5 (default: all)
#   env: OUT (default ./peer-suites), PYTHON (default .venv/bin/python),
#        RUN_SECONDS (limit of one pytest run, default 1800), HF_K (a -k expression for the
#        transformers runs, e.g. "attention or sdpa or mask or compile"; default: every test)
#
# The suites and their runs (OUT/<suite>.<run>.xml, counts in OUT/<suite>.<run>.count.json):
#   torch    test/nn/test_multihead_attention.py and class TestTransformers of test/test_transformers.py
#            baseline | mha: torch.nn.MultiheadAttention is attnkit.nn.MultiheadAttention (attnkit_mha.py)
#                     | sdpa: F.scaled_dot_product_attention is attnkit's (attnkit_sdpa.py)
#   <family> tests/models/<family>/test_modeling_<family>.py with transformers' shared testers
#            baseline | attnkit: AttentionInterface/AttentionMaskInterface "sdpa" are attnkit's
#            (attnkit_hf.py); for gemma2 and gpt_oss "eager" too, since their tests run eager
#   qwen3_next, qwen3_5  the same files of the hybrid models
#            baseline | attnkit: their Gated DeltaNet layers run attnkit.hf.linear's functions
#            (use_gated_delta_rule, attnkit_linear.py); their softmax layers stay transformers'
#
# Getting the peers' files (their code: keep them outside this repository, never commit them):
#   git clone --depth 1 --branch v2.13.0 --filter=blob:none --sparse \
#       https://github.com/pytorch/pytorch PEERS/pytorch && git -C PEERS/pytorch sparse-checkout set test
#   git clone --depth 1 --branch v5.24.0 https://github.com/huggingface/transformers PEERS/transformers
# (the tags of torch==2.13.0 and transformers==5.24.0 in constraints.txt / the venv). Without
# network access to GitHub, docs/bench/peer-suites.md says how the record's copy was put together.
# The tests need, beyond attnkit's test tooling: pip install parameterized expecttest
# (PyTorch's torch.testing._internal imports expecttest; transformers' testers use parameterized).
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
peers=${1:?usage: scripts/peer-suites.sh PEERS [SUITE...]}
peers=$(cd "$peers" && pwd) || exit 2
shift
suites=("$@")
[[ ${#suites[@]} -gt 0 ]] || suites=(torch llama mistral qwen2 gemma2 gpt_oss qwen3_next qwen3_5)
PY=${PYTHON:-$here/.venv/bin/python}
OUT=${OUT:-peer-suites}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONPATH=$here/scripts/peer_plugins:$here/src${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1  # no test reaches the Hub
failed_substitution=0

# run SUITE RUN DIR PLUGIN(or -) FILES...: one bounded pytest run, its JUnit XML and stand-in counts
run() {
  local suite=$1 name=$2 dir=$3 plugin=$4
  shift 4
  local plugin_args=()
  [[ $plugin == - ]] || plugin_args=(-p "$plugin")
  local k_args=()
  [[ $suite == torch || -z ${HF_K:-} ]] || k_args=(-k "$HF_K")
  echo "== $suite / $name ($(date -u +%H:%M:%S))"
  rm -f "$OUT/$suite.$name.count.json"
  (cd "$dir" && ATTNKIT_PEER_REPORT="$OUT/$suite.$name.count.json" \
    timeout -s INT -k 60 "${RUN_SECONDS:-1800}" "$PY" -m pytest -p no:cacheprovider "${plugin_args[@]}" \
    -q --no-header -rN --tb=no "${k_args[@]}" --junitxml="$OUT/$suite.$name.xml" "$@" \
    > "$OUT/$suite.$name.log" 2>&1)
  echo "   rc=$? $(tail -n 1 "$OUT/$suite.$name.log")"
  if [[ $plugin != - ]] && ! grep -q '"calls": [1-9]' "$OUT/$suite.$name.count.json" 2>/dev/null; then
    echo "   attnkit's stand-in was never called in this run: the substitution did not happen"
    failed_substitution=1
  fi
}

torch_files=(test/nn/test_multihead_attention.py test/test_transformers.py::TestTransformersCPU)
for suite in "${suites[@]}"; do
  case $suite in
    torch)
      for pair in "baseline -" "mha attnkit_mha" "sdpa attnkit_sdpa"; do
        read -r name plugin <<< "$pair"
        run torch "$name" "$peers/pytorch" "$plugin" "${torch_files[@]}"
      done
      ;;
    *)
      file=tests/models/$suite/test_modeling_$suite.py
      [[ -f $peers/transformers/$file ]] || { echo "no $file in $peers/transformers"; exit 2; }
      entries=sdpa
      [[ $suite == gemma2 || $suite == gpt_oss ]] && entries=sdpa,eager
      run "$suite" baseline "$peers/transformers" - "$file"
      if [[ $suite == qwen3_next || $suite == qwen3_5 ]]; then
        run "$suite" attnkit "$peers/transformers" attnkit_linear "$file"
      else
        ATTNKIT_HF_ENTRIES=$entries run "$suite" attnkit "$peers/transformers" attnkit_hf "$file"
      fi
      ;;
  esac
done

{
  echo "attnkit $(git -C "$here" rev-parse --short HEAD)$(git -C "$here" diff --quiet HEAD -- src || echo ' + uncommitted changes in src/')," \
    "$("$PY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')," \
    "$(date -u +%Y-%m-%d), $(lscpu | sed -n 's/^Model name: *//p')"
  echo
  "$PY" "$here/scripts/peer_plugins/report.py" "$OUT"
} > "$OUT/report.md"
cat "$OUT/report.md"
exit $failed_substitution
