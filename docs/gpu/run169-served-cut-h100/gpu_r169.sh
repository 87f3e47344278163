#!/usr/bin/env bash
# run 169: the served mixed batch at 256, old (e02b0fb) and this change, one machine
source .gpukit/unpack.sh >/dev/null; source scripts/gpu_env.sh >/dev/null
python3 -c "import sys; sys.path.insert(0,'benchmarks'); from make_model import build; build('qwen2-1.5b','/tmp/vh_models')" >/dev/null 2>&1
M=/tmp/vh_models/qwen2-1.5b; R=/tmp/r169; mkdir -p $R
python3 -c "import sys; sys.path[:0]=['benchmarks','src']; from run import host_probe; print(host_probe())" > $R/probe.txt 2>&1
for v in ${VARIANTS:-old new}; do
  if [ $v = old ]; then PP="$PWD/old_src:$PYTHONPATH"; else PP="$PYTHONPATH"; fi
  PYTHONPATH=$PP timeout 250 python3 benchmarks/throughput_served.py --model $M --out $R/$v --reps ${REPS:-6} --gpu-mem 0.3 \
    --batches 256x128+128 --workloads mixed_thirds --deliveries files > $R/$v.log 2>&1
  echo "$v rc=$?" >> $R/probe.txt
done
python3 -c "import sys; sys.path[:0]=['benchmarks','src']; from run import host_probe; print(host_probe())" >> $R/probe.txt 2>&1
(cd /tmp && tar cJf $OUT/r169.tar.xz r169)
tail -5 $R/probe.txt; grep -h "mixed_thirds" $R/*/report.md 2>/dev/null | head -4
