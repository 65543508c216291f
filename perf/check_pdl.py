"""Tokens and logits of a tiny NVFP4 checkpoint (FP8 paged cache) under this process's switches
(`DLMC_PDL`, `TORCHINDUCTOR_ENABLE_PDL`), for comparing launches across processes.

    python3 perf/check_pdl.py --model DIR --write          # the checkpoint, once
    DLMC_PDL=1 python3 perf/check_pdl.py --model DIR --out NAME --mode graph
    python3 perf/check_pdl.py --compare NAME...            # tokens / logits against the first

Two processes that each compile the model need not agree bit for bit (session 18: the default's
first token differed between two calls); set one TORCHINDUCTOR_CACHE_DIR for processes whose
compiled graphs should be the same (tests/custom_ops/test_pdl.py does). The tokens compare the
rounds (eager, or compiled and graph-replayed). The logits are `LLM.logits` of one fixed
sequence (`FIXED_IDS`), a plain eager forward: they check that each process loaded the same
model, not the compiled rounds. (Before session 19 they were of each run's own tokens, so runs
whose tokens differed also differed there by construction.)
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

FIXED_IDS = list(range(60, 110)) + list(range(200, 246))


def write(model: Path) -> None:
    from dlmc.loading.tiny import write_tiny_checkpoint
    from dlmc.quant.export import export_nvfp4

    src = write_tiny_checkpoint(model.parent / (model.name + "-bf16"), seed=4, shards=1)
    export_nvfp4(src, model, kv_scales={layer: (0.5, 0.25) for layer in range(3)})


def generate(model: Path, out: str, mode: str, rounds: int, device: str) -> None:
    from dlmc import LLM
    from dlmc.custom_ops import _pdl

    llm = LLM(str(model), device=device, precision="nvfp4", mode=mode)
    runs = []
    for _ in range(rounds):  # the same prompt again: graph replays must repeat themselves
        res = llm.generate(prompt_token_ids=list(range(60, 110)), max_new_tokens=64)
        runs.append(res.token_ids)
    # logits of one fixed sequence (not of the generated tokens, which may differ by process)
    torch.save(llm.logits(FIXED_IDS).cpu(), f"{out}.pt")
    switches = {k: os.environ.get(k, "") for k in ("DLMC_PDL", "TORCHINDUCTOR_ENABLE_PDL")}
    result = {"mode": mode, "pdl_mode": _pdl.MODE, "switches": switches, "tokens": runs}
    Path(f"{out}.json").write_text(json.dumps(result))
    print(json.dumps({"out": out, "pdl_mode": _pdl.MODE, "first_tokens": runs[0][:8],
                      "runs_equal": all(r == runs[0] for r in runs)}))


def compare(names: list[str]) -> None:
    base = json.loads(Path(f"{names[0]}.json").read_text())
    base_logits = torch.load(f"{names[0]}.pt")
    for name in names:
        res = json.loads(Path(f"{name}.json").read_text())
        logits = torch.load(f"{name}.pt")
        diff = logits.float() - base_logits.float()
        same_tokens = res["tokens"][0] == base["tokens"][0]
        first_diff = next((i for i, (a, b) in enumerate(zip(res["tokens"][0], base["tokens"][0],
                                                              strict=False)) if a != b), None)
        print(f"{Path(name).name:24s} mode={res['mode']:6s} pdl={res['pdl_mode']:7s} "
              f"inductor_pdl={res['switches']['TORCHINDUCTOR_ENABLE_PDL'] or '0'} "
              f"repeat_equal={all(r == res['tokens'][0] for r in res['tokens'])} "
              f"tokens_equal={same_tokens} first_diff={first_diff} "
              f"logits_equal={torch.equal(logits, base_logits)} "
              f"max_abs={diff.abs().max().item():.3g} "
              f"rel_norm={(diff.norm() / base_logits.float().norm()).item():.3g} "
              f"max_logit={base_logits.float().abs().max().item():.3g}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--mode", default="graph")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--compare", nargs="+")
    args = ap.parse_args()
    if args.compare:
        compare(args.compare)
    elif args.write:
        write(args.model)
    else:
        generate(args.model, args.out, args.mode, args.rounds, args.device)


if __name__ == "__main__":
    main()
