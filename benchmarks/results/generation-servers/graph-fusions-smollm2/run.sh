#!/bin/bash
# kiln serve, the build before the graph's fusions (old: 9a5fe63, its own conversion with Split nodes, onnxruntime's
# norms and the Mul before the down projection) and after (new: split outputs, KilnSkipNorm, the product inside the
# matmul; its own conversion), in turns: old, new, new, old
cd /work/main
i=0
for b in old new new old; do
  i=$((i+1))
  if [ $b = old ]; then P=/tmp/wt-old/src; A=/work/art/smollm2-f16; else P=/work/main/src; A=/work/art/smollm2-mul; fi
  echo "== run $i build $b $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  PYTHONPATH=$P timeout 900 .venv/bin/python benchmarks/generation/generation_servers.py --artifact $A \
    --servers "kiln serve" --kiln-protocols openai-chat --rounds 1 --concurrency 16,64 --modes greedy,sampled \
    --max-batch 64 --max-inputs 64 --out /tmp/ab2/$i-$b > /tmp/ab2/$i-$b.log 2>&1
  grep -E "^\| kiln" /tmp/ab2/$i-$b/table.txt
done
