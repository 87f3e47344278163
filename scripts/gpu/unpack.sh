#!/usr/bin/env bash
# Runs on the GPU machine, from the project's root (scripts/gpu/build-kit.sh fills in the
# version and the part count). Run it (bash) or source it in every device call: keeps each
# carried part in /tmp/kit-@VERSION@; once all @PARTS@ have arrived, unpacks them to
# /tmp/site-@VERSION@. Sourced, it also exports PYTHONPATH and the settings of the 0.26 kit.
kit_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
keep=/tmp/kit-@VERSION@ site=/tmp/site-@VERSION@
mkdir -p "$keep"
for p in "$kit_dir"/part-*; do [ -e "$p" ] && mv -f "$p" "$keep/"; done
want=@PARTS@
have=$(ls "$keep" | grep -c '^part-' || true)
if [ ! -f "$site/.complete" ]; then
  if [ "$have" = "$want" ]; then
    mkdir -p "$site" && cat "$keep"/part-* | xz -d | tar -x -C "$site" && touch "$site/.complete"
    echo "gpukit @VERSION@: unpacked $have parts to $site"
  else
    echo "gpukit @VERSION@: $have of $want parts on this machine; carry the next part in the next call"
  fi
fi
if [ -f "$site/.complete" ]; then
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
  export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  echo "gpukit @VERSION@: ready ($(python3 -c 'import torch, vllm; print("vllm", vllm.__version__, "torch", torch.__version__)' 2>&1 | tail -1))"
fi
