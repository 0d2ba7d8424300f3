"""Nsight Compute with SASS-level stall sampling (.gpu/ncu_src.sh at commit 5a2bc07: the kernels tested whole at
2863ae3), attn_in and mlp_in of layer 0 at the third decode step of a 4-layer Llama-3.1-8B-shaped q4q8 model
(.gpu/ncu_probe.py as in results/h200-20261202-062000-ncu_fused.py). The run:
    #!/bin/bash
    # Nsight Compute, full set with SASS-level stall sampling, on attn_in and mlp_in of layer 0 (3rd decode step), q4q8
    export PYTHONPATH=/root/site:$PWD
    NCU=/usr/local/cuda/bin/ncu
    timeout 300 $NCU -k "regex:ref_layer_(attn_in|mlp_in)" --launch-skip 16 --launch-count 2 --set full \
      -o /root/rep python3 .gpu/ncu_probe.py q4q8 > $OUT/ncu_src_run.txt 2>&1
    echo "ncu rc $?"; tail -3 $OUT/ncu_src_run.txt
    $NCU -i /root/rep.ncu-rep --page details --print-details all > $OUT/ncu_src_details.txt 2>&1
    $NCU -i /root/rep.ncu-rep --page source --print-source sass --csv > $OUT/ncu_src_sass.csv 2>&1
    $NCU -i /root/rep.ncu-rep --page raw --csv > $OUT/ncu_src_raw.csv 2>&1
    ls -la $OUT
"""
# This file, run: the top stall locations of each kernel from the SASS page (-ncu_sass.csv.xz), to -ncu_stalls.log
import csv
import io
import lzma
import sys
from pathlib import Path

here = Path(__file__).with_name(Path(__file__).name.replace("-ncu_stalls.py", "-ncu_sass.csv.xz"))
out = []
for part in lzma.open(here, "rt").read().split('"Kernel Name",')[1:]:
    name, _, table = part.partition("\n")
    rows = list(csv.reader(io.StringIO(table)))
    head, body = rows[0], [r for r in rows[1:] if len(r) == len(rows[0])]
    samples, source = head.index("Warp Stall Sampling (All Samples)"), head.index("Source")
    executed = head.index("Instructions Executed")
    total = sum(float(r[samples] or 0) for r in body)
    kernel = name.split("ref_layer_")[1].split("_")[0:2]
    out.append(f"{'_'.join(kernel)}: {len(body)} SASS instructions, {total:.0f} warp stall samples; the 8 most sampled:")
    top = sorted(range(len(body)), key=lambda j: -float(body[j][samples] or 0))[:8]
    for j in sorted(top):
        loads = [i for i in range(max(0, j - 40), j) if body[i][source].strip().split()[0].startswith("LDG")
                 or " LDG" in body[i][source]]
        before = f"; the nearest load before it: #{loads[-1]} {body[loads[-1]][source].strip()}" if loads else ""
        out.append(f"  #{j:<5} {100 * float(body[j][samples]) / total:5.1f}% of samples, executed {body[j][executed]:>6} "
                   f"times: {body[j][source].strip()}{before}")
text = "\n".join(out) + "\n"
if len(sys.argv) > 1:
    Path(sys.argv[1]).write_text(text)
print(text, end="")
