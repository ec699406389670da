"""Batch of one: tokens/s of an engine on the embedded pair, 2 prompts x 64 tokens per mode.

    python scripts/measure_batch1.py DTYPE old|plain|packed      (one JSON line)

`old`: whatever `viasd` is first on PYTHONPATH (scripts/measure_batch1.sh puts the baseline
commit's checkout there); `plain`: this engine with packed_linears=false; `packed`: the default.
"""

import json
import sys
import time

import torch

import viasd
from viasd.config import EngineConfig, parse_params
from viasd.llm import LLM

torch.set_num_threads(2)
extra = {"packed_linears": sys.argv[2] == "packed"} if len(sys.argv) > 2 and sys.argv[2] != "old" else {}
llm = LLM(EngineConfig(dtype=sys.argv[1], **extra))
prompts = ["def fibonacci(n):", 'def quicksort(xs):\n    """Sort a list."""\n']
out = {
    "engine": "old" if "old" in viasd.__file__ else "new",
    "variant": sys.argv[2:],
    "dtype": sys.argv[1],
    "capability": torch.backends.cpu.get_cpu_capability(),
}
llm.complete(llm.encode(prompts[0]), parse_params(mode="ar", max_tokens=4))  # warm up
for mode in ("ar", "sd", "via"):
    toks, secs = 0, 0.0
    for p in prompts:
        ids = llm.encode(p)
        t0 = time.perf_counter()
        r = llm.complete(ids, parse_params(mode=mode, max_tokens=64, ignore_eos=True))
        secs += time.perf_counter() - t0
        toks += len(r.token_ids)
    out[mode] = round(toks / secs, 3)
print(json.dumps(out), flush=True)
