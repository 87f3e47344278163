#!/usr/bin/env bash
# Source on the lent GPU machine (no network):
#   source scripts/gpu_env.sh          # vLLM 0.26 from ../shared/gpu's kit (.gpukit/)
#   source scripts/gpu_env.sh 0.33     # vLLM 0.33 from scripts/gpu/build-kit.sh (.gpukit-0.33/)
# Unpacks/activates the kit, puts src/ on PYTHONPATH and registers vllm-hook's entry points
# (vLLM finds plugins through installed package metadata) without pip.
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -n "${1:-}" ]; then
  source "$here/.gpukit-$1/unpack.sh"; site=/tmp/site-$1
else
  source "$here/.gpukit/unpack.sh"; site=/tmp/site
fi
# Two-GPU runs (issue 21) keep NVLink multicast off.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$here/src:$here/benchmarks:${PYTHONPATH:-}"
di=$site/vllm_hook-0.1.0.dist-info
mkdir -p "$di"
printf 'Metadata-Version: 2.1\nName: vllm-hook\nVersion: 0.1.0\n' >"$di/METADATA"
awk '/^\[project.entry-points/{gsub(/\[project.entry-points."|"\]/,""); print "[" $0 "]"; on=1; next} /^\[/{on=0} on && NF' \
  "$here/pyproject.toml" | tr -d '"' >"$di/entry_points.txt"
python3 -c "from importlib.metadata import entry_points as e; print('vllm-hook plugins:', [x.name for x in e(group='vllm.general_plugins')])"
