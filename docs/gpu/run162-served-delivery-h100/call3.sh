# run 162 part 1: where a served client's time per result goes on this host; 4 variants of src/
R=/tmp/r162; mkdir -p $R
(cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag; nproc; python3 -c "import torch; print(torch.get_num_threads())") > $R/host.txt 2>&1
python3 gpu_probe/widen_probe.py > $R/widen1.json 2>&1
for i in 1; do for v in old torch1 host1 torch; do
  case $v in old) P=$PWD/gpu_old_src;; torch1) P=$PWD/src;; host1) P=$PWD/gpu_v_host1;; torch) P=$PWD/gpu_v_torch;; esac
  timeout 100 python3 benchmarks/served_delivery.py --results 85 --rounds 3 --per-response 1 --src $P --out $R/sd_${v}_$i.json > $R/sd_${v}_$i.log 2>&1
done; done
for v in torch1 old; do case $v in old) P=$PWD/gpu_old_src;; torch1) P=$PWD/src;; esac; timeout 100 python3 benchmarks/served_delivery.py --results 85 --rounds 3 --per-response 1 --src $P --out $R/sd_${v}_2.json > $R/sd_${v}_2.log 2>&1; done
cat $R/host.txt $R/widen1.json
for f in $R/sd_*.json; do echo $f; python3 -c "import json,sys; d=json.load(open('$f')); print({k:{kk:v for kk,v in d[k].items() if 'client' in kk or 'wall' in kk} for k in ('from_files','over_http')}, d['host']['python_loop_ms'])"; done
cd /tmp && tar cJf $OUT/r162.tar.xz r162
