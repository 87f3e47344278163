#!/usr/bin/env bash
# Builds a GPU kit for the lent H200 (no network there): vLLM VERSION, trimmed for Hopper, plus the
# packages the machine's image lacks, as <repo>/.gpukit-VERSION/part-* with unpack.sh beside them.
#
#   bash scripts/gpu/build-kit.sh 0.33 [PART_MIB]     # from the project's root
#
# 0.26 is ../shared/gpu/build-kit.sh's kit (the image's torch 2.11). 0.33 brings torch 2.14.0,
# triton 3.8.0 and NCCL 2.30.7 (scripts/gpu/requirements-0.33.txt, on top of the shared 0.26
# list) and a torchvision stub (scripts/gpu/torchvision_stub.py). PART_MIB
# (default 56): a device call carries at most 64 MiB with the tracked tree. Ship one part per
# call, back to back (the machine stays warm 30 s), each call carrying its part and unpack.sh:
#   bash .gpukit-0.33/unpack.sh                  # every call; the last one unpacks
# then every command there starts with `source scripts/gpu_env.sh 0.33`.
set -euo pipefail
version=${1:?usage: build-kit.sh VERSION [PART_MIB]}
part_mib=${2:-56}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(git -C "$here" rev-parse --show-toplevel)
shared=$repo/../shared/gpu
case $version in
  0.33) vllm_pin=vllm==0.33.0; reqs=("$shared/requirements-gpu.txt" "$here/requirements-0.33.txt") ;;
  *) echo "no kit recipe for vLLM $version (0.26: bash ../shared/gpu/build-kit.sh)" >&2; exit 2 ;;
esac
kit=$repo/.gpukit-$version
work=${TMPDIR:-/tmp}/gpukit-$version
grep -qx "/.gpukit-$version/" "$repo/.git/info/exclude" 2>/dev/null || echo "/.gpukit-$version/" >>"$repo/.git/info/exclude"
rm -rf "$work" "$kit" && mkdir -p "$work/wheels" "$work/site" "$kit"

# One pin per package: the version's own list wins over the shared 0.26 list.
python3 - "$work/reqs.txt" "${reqs[@]}" <<'PY'
import re, sys
pins = {}
for path in sys.argv[2:]:
    for line in open(path):
        line = line.split("#")[0].strip()
        if line:
            pins[re.split(r"[=<>!~ ]", line)[0].lower().replace("_", "-")] = line
open(sys.argv[1], "w").write("\n".join(pins.values()) + "\n")
PY

plat=(--only-binary=:all: --python-version 3.12 --implementation cp)
for p in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_18 \
         manylinux_2_17 manylinux2014 manylinux_2_12 manylinux2010 manylinux_2_5 manylinux1; do
  plat+=(--platform "${p}_x86_64")
done
echo "downloading wheels ..."
pip download -q --no-deps "${plat[@]}" -d "$work/wheels" "$vllm_pin" -r "$work/reqs.txt" 2>&1 | grep -v '^WARNING: Location' || true

# Trim vllm for a Hopper GPU: FlashAttention 2 (Hopper runs FA3), the Rust frontend, MLA and
# Blackwell kernels. The MoE kernels stay (the MoE parity of issue 19).
whl=$(ls "$work"/wheels/vllm-*.whl)
zip -q -d "$whl" 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' 'vllm/vllm-rs' 'vllm/_flashmla_C.abi3.so' \
  'vllm/_flashkda_C.abi3.so' 'vllm/_deepselect_C.abi3.so' 'vllm/third_party/fmha_sm100/*' >/dev/null
# Trim torch: its tests and the protobuf compiler.
zip -q -d "$(ls "$work"/wheels/torch-*.whl)" 'torch/bin/protoc*' 'torch/test/*' >/dev/null 2>&1 || true

echo "unpacking into a site folder ..."
pip install -q --no-deps --no-compile --target "$work/site" "${plat[@]}" "$work"/wheels/*.whl 2>&1 | grep -v '^WARNING' || true
# The image's torchvision (built for torch 2.11) must not load beside this torch: a stub instead.
mkdir -p "$work/site/torchvision" && cp "$here/torchvision_stub.py" "$work/site/torchvision/__init__.py"
du -sh "$work/site"
echo "compressing (xz) ..."
tar -cf - -C "$work/site" . | xz -T0 -6 >"$work/kit.tar.xz"
(cd "$kit" && split -b "${part_mib}M" -a 2 "$work/kit.tar.xz" part-)
parts=$(ls "$kit" | grep -c '^part-')
sed -e "s/@PARTS@/$parts/" -e "s/@VERSION@/$version/g" "$here/unpack.sh" >"$kit/unpack.sh" && chmod +x "$kit/unpack.sh"
rm -rf "$work"
echo "kit ready: $parts parts of up to $part_mib MiB in .gpukit-$version/"
ls -l "$kit"
