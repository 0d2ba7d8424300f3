"""Nsight Compute run (.gpu/ncu.sh at the tree of commit this file lands in, LOOPS 1, PREFETCH 0):
# #!/bin/bash
# # Nsight Compute on the fused kernels: 3rd and 4th decode steps' kernels of layer 0-1 (after the JIT warm-up)
# export PYTHONPATH=/root/site:$PWD
# NCU=/usr/local/cuda/bin/ncu
# for q in q4q8 f16; do
#   timeout 200 $NCU -k regex:ref_layer --launch-skip 40 --launch-count 10 \
#     --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
#     --section MemoryWorkloadAnalysis --section SchedulerStats --section ComputeWorkloadAnalysis \
#     python3 .gpu/ncu_probe.py $q > $OUT/ncu_$q.txt 2>&1
#   echo "$q rc $?"; grep -c "ref_layer" $OUT/ncu_$q.txt; grep -m3 "ERR\|error" $OUT/ncu_$q.txt
# done
"""
import dataclasses
import sys

sys.path.insert(0, ".")
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from ref_impl.engine.generate import decoder, prefill  # noqa: E402
from ref_impl.engine.random import args_for, random_model  # noqa: E402
from ref_impl.kernels import fusedlayer as fl  # noqa: E402

quant = sys.argv[1]
args = dataclasses.replace(args_for("Llama-3.1-8B", context=512), num_hidden_layers=4)
model = random_model(args, mx.float16, 0)
if quant == "q4q8":
    nn.quantize(model, class_predicate=lambda path, m: isinstance(m, nn.Linear) and not path.endswith("lm_head") and {
        "group_size": 32, "bits": 8 if path.endswith(("v_proj", "down_proj")) else 4})
mx.eval(model.parameters())
print(quant, fl.fuse(model), flush=True)
cache = model.make_cache(300)
y = mx.argmax(prefill(model, mx.zeros((1, 256), dtype=mx.int32), cache), axis=-1)
step = decoder(model, cache)
for _ in range(4):
    y = mx.argmax(step(y), axis=-1)
    mx.eval(y)
print("done", flush=True)
