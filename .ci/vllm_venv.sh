# Sourced by the vLLM stages (.ci/vllm_conformance.sh, .ci/vllm033_pipeline.sh): a venv of its
# own holding one pinned vLLM, and the loud "NOT RUN" exit when vLLM cannot be had.
#   STAGE="..." (the stage's name in NOT RUN lines)
#   ensure_vllm_venv VENV DIST VERSION   creates VENV if needed, installs DIST==VERSION and pytest
# HISPARSE_ALLOW_NO_VLLM=1 makes NOT RUN exit 0 (still printed). Test failures always fail.

not_run() {
    echo "======================================================================"
    echo "${STAGE:-VLLM CONFORMANCE} NOT RUN: $*"
    echo "======================================================================"
    if [ "${HISPARSE_ALLOW_NO_VLLM:-0}" = "1" ]; then
        echo "(HISPARSE_ALLOW_NO_VLLM=1: not failing the build)"
        exit 0
    fi
    exit 1
}

ensure_vllm_venv() {
    local venv=$1 dist=$2 version=$3
    local pin="$dist==$version"
    if [ ! -x "$venv/bin/python" ]; then
        python3 -m venv "$venv" || not_run "python3 -m venv $venv failed"
    fi
    if ! "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('$dist') != '$version')" 2>/dev/null; then
        echo "--- installing $pin into $venv (large; a few minutes)"
        "$venv/bin/pip" install --disable-pip-version-check "$pin" pytest \
            || not_run "pip install $pin failed"
        "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('$dist') != '$version')" \
            || not_run "$pin is not installed in $venv after pip install"
    fi
    "$venv/bin/pip" install --disable-pip-version-check -q pytest || not_run "pip install pytest failed"
}
