"""Adds a run's header (its .txt's first lines: date, CPU, load, commit, command; and the footer's
load) to its summary JSON as "run", with the CPU's model and instruction set from this machine:
    python3 add_run.py RUN.txt RUN.json"""

import json
import platform
import sys

txt, path = sys.argv[1], sys.argv[2]
lines = open(txt).read().splitlines()
run = {}
for line in lines[:6] + lines[-1:]:
    key, sep, value = line.partition(": ")
    if sep and key in ("date", "cpu", "load average before", "commit", "command", "load average after"):
        run[key.replace(" ", "_")] = value
info = {}
for line in open("/proc/cpuinfo"):
    key, _, value = line.partition(":")
    info.setdefault(key.strip(), value.strip())
flags = info.get("flags", "").split()
run["cpu_model"] = info.get("model name", platform.processor())
run["cpu_family_model"] = f"family {info.get('cpu family')} model {info.get('model')}"
run["isa"] = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "other"
run["isa_used"] = ("pserver's numba kernels and NumPy's OpenBLAS, each picking the CPU's widest "
                   "(OPENBLAS_CORETYPE unset)")
summary = json.load(open(path))
summary["run"] = run
json.dump(summary, open(path, "w"), indent=2, sort_keys=True)
