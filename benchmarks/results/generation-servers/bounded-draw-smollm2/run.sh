#!/bin/bash
# kiln serve, the build before the bounded draw (old) and after (new), in turns: old, new, new, old
cd /work/main
i=0
for b in old new new old; do
  i=$((i+1))
  if [ $b = old ]; then P=/tmp/wt_old/src; else P=/work/main/src; fi
  echo "== run $i build $b $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  PYTHONPATH=$P timeout 900 .venv/bin/python benchmarks/generation/generation_servers.py --artifact /work/art/smollm2-f16 \
    --servers "kiln serve" --kiln-protocols openai-chat --rounds 1 --concurrency 16,64 --modes greedy,sampled \
    --max-batch 64 --max-inputs 64 --out /tmp/ab/$i-$b > /tmp/ab/$i-$b.log 2>&1
  grep -E "^\| kiln" /tmp/ab/$i-$b/table.txt
done
