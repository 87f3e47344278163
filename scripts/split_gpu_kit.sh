#!/usr/bin/env bash
# Re-split the GPU kit (../shared/gpu/build-kit.sh writes .gpukit/part-aa, part-ab of up to
# 60 MiB) into parts of 40 MiB: a device call carries at most 64 MiB with the tracked tree,
# which is over 4 MiB. Then ship one part per call, back to back (docs/benchmarks.md, "How to
# run on the lent GPU").
set -euo pipefail
cd "$(dirname "$0")/../.gpukit"
cat part-* > /tmp/gpukit.xz
rm -f part-*
split -b 40M -a 2 /tmp/gpukit.xz part-
rm -f /tmp/gpukit.xz
n=$(ls part-* | wc -l)
sed -i "s/^want=[0-9]* /want=$n /" unpack.sh
echo "kit: $n parts"; ls -l part-*
