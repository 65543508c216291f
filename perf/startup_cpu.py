"""First vs second start of compiled rounds (Inductor's FX-graph cache persisted in dlmc's cache
directory), on the CPU with the tiny model. Each start is a fresh process.

    python perf/startup_cpu.py --out perf/results/startup_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = """
import json, time
t0 = time.perf_counter()
from dlmc import LLM
llm = LLM("tiny-llada2", device="cpu", mode="compile")
t1 = time.perf_counter()
res = llm.generate(prompt_token_ids=list(range(40, 100)), max_new_tokens=64)
t2 = time.perf_counter()
runner = llm._decoder.runner(32)
print(json.dumps({"load_s": t1 - t0, "first_generate_s": t2 - t1,
                  "compile_s": runner.compile_s, "tokens": len(res.token_ids)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="dlmc-startup-")
    env = {**os.environ, "DLMC_CACHE": cache}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    runs = []
    for start in ("first", "second"):
        out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                             text=True, check=True)
        runs.append({"start": start, **json.loads(out.stdout.strip().splitlines()[-1])})
        print(runs[-1])
    import platform

    import torch

    report = {"device": "cpu", "torch": torch.__version__, "python": platform.python_version(),
              "model": "tiny-llada2", "runs": runs}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
