"""Benchmark transformers' DiffusionGemma denoising step: the Hugging Face code dlmc's step is
compared against, on the same GPU and the same shape.

transformers' `DiffusionGemmaForBlockDiffusion` is built from dlmc's `diffusiongemma-26b-a4b`
shape (`DiffusionGemmaConfig.to_dict()`, plus a one-layer vision tower that no step runs) with
random bf16 weights made on the GPU. Its own `generate` runs over a `--prefix`-token random
prompt for one canvas and exactly S denoising steps (the stopping criterion's stability
threshold is out of reach). A step's time is the slope between two step counts:
(median wall time at S_hi - median at S_lo) / (S_hi - S_lo), so the encoder pass over the
prompt and the set-up of each call cancel out; what remains is transformers' whole step
(decoder forward, temperature, sampling, acceptance, re-noise, stopping check, host work).

Paths: `eager` (transformers' default dynamic cache, which its generate does not compile) and
`compiled` (a static cache, with which transformers' generate compiles the encoder, the decoder
forward and the sampler with mode="reduce-overhead", i.e. CUDA graphs). The routing is the
random model's own (all experts are touched at 256 tokens x top-8 of 128). With `--against`,
the JSON of `dlmc bench round --shape diffusiongemma-26b-a4b --out ...` from the same call
gives the ratio.

    python perf/bench_hf_gemma.py --out /tmp/hf_gemma.json --against /tmp/canvas_bf16_bf16.json
    python perf/bench_hf_gemma.py --tiny --paths eager   # a tiny model on the CPU: a smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from dlmc.loading.tiny_gemma import TINY_VISION_CONFIG, tiny_gemma_config_json
from dlmc.models.diffusion_gemma_config import DiffusionGemmaConfig
from dlmc.models.shapes import DIFFUSIONGEMMA_26B_A4B

PATHS = ("eager", "compiled")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefix", type=int, default=1024, help="prompt tokens before the canvas")
    p.add_argument("--steps", type=int, nargs=2, default=(2, 8), metavar=("S_LO", "S_HI"),
                   help="the two step counts whose times give a step's slope")
    p.add_argument("--repeats", type=int, default=3, help="timed generate calls per count")
    p.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    p.add_argument("--experts", default=None,
                   help="transformers' experts_implementation (default: its own choice)")
    p.add_argument("--against", type=Path, default=None,
                   help="dlmc bench round's JSON (same shape, same call): print the ratio")
    p.add_argument("--tiny", action="store_true", help="the tiny test shape (a CPU smoke run)")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = p.parse_args()
    if not 0 < args.steps[0] < args.steps[1]:
        p.error(f"--steps: S_LO must be positive and below S_HI (got {args.steps})")
    if args.repeats < 1 or args.prefix < 1:
        p.error("--repeats and --prefix must be positive")
    if args.against is not None and not args.against.is_file():
        p.error(f"--against: no file {args.against}")
    return args


def hf_model(config: DiffusionGemmaConfig, device: torch.device, experts: str | None) -> Any:
    """transformers' model of `config` with its own random initialisation, bf16, on `device`."""
    import transformers
    from transformers.models.diffusion_gemma import modeling_diffusion_gemma as hf

    hf_config = transformers.DiffusionGemmaConfig(
        **{**config.to_dict(), "vision_config": TINY_VISION_CONFIG})
    kwargs = {} if experts is None else {"experts_implementation": experts}
    torch.manual_seed(0)
    with torch.device(device):
        model = hf.DiffusionGemmaForBlockDiffusion._from_config(
            hf_config, dtype=torch.bfloat16, **kwargs)
    return model.eval()


def generate_seconds(model: Any, prompt: torch.Tensor, canvas: int, steps: int, path: str,
                     ) -> float:
    """Wall time of one `generate` of one canvas in exactly `steps` denoising steps."""
    # transformers compiles its step only with a compileable (static) cache
    options: dict[str, Any] = {} if path == "eager" else {"cache_implementation": "static"}
    sync = torch.cuda.synchronize if prompt.is_cuda else (lambda: None)
    sync()
    started = time.perf_counter()
    model.generate(input_ids=prompt[None], max_new_tokens=canvas, max_denoising_steps=steps,
                   stability_threshold=steps + 1, **options)
    sync()
    return time.perf_counter() - started


def time_path(model: Any, prompt: torch.Tensor, canvas: int, args: argparse.Namespace,
              path: str) -> dict[str, Any]:
    """A step's time on `path`: the slope between the two step counts' median walls."""
    started = time.perf_counter()
    generate_seconds(model, prompt, canvas, args.steps[1], path)  # warm-up (compile, capture)
    warmup_s = time.perf_counter() - started
    walls = {s: sorted(generate_seconds(model, prompt, canvas, s, path)
                       for _ in range(args.repeats)) for s in args.steps}
    lo, hi = (statistics.median(walls[s]) for s in args.steps)
    step_ms = (hi - lo) / (args.steps[1] - args.steps[0]) * 1e3
    return {"path": path, "step_ms": step_ms, "warmup_s": warmup_s,
            "walls_s": {str(s): w for s, w in walls.items()},
            "rest_ms": lo * 1e3 - args.steps[0] * step_ms}


def dlmc_step_ms(report: dict[str, Any]) -> tuple[float, str]:
    """(median ms, mode) of dlmc's fastest timed mode in a `bench round` report."""
    best = min(report["results"], key=lambda r: r["median_ms"])
    return best["median_ms"], best["mode"]


def main() -> None:
    args = parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    config = (DiffusionGemmaConfig.from_dict(tiny_gemma_config_json()) if args.tiny
              else DIFFUSIONGEMMA_26B_A4B)
    canvas = config.canvas_length
    started = time.perf_counter()
    model = hf_model(config, device, args.experts)
    text_config = model.config.get_text_config()
    kernels = {name: getattr(text_config, f"_{name}_implementation", None)
               for name in ("attn", "experts")}
    print(f"built transformers' model ({sum(p.numel() for p in model.parameters()) / 1e9:.2f}"
          f"B parameters) in {time.perf_counter() - started:.1f} s; attention "
          f"{kernels['attn']}, experts {kernels['experts']}", flush=True)
    gen = torch.Generator(device=device).manual_seed(1)
    # Prompt ids away from the special tokens (0-3 and the turn markers near 100).
    prompt = torch.randint(200, config.vocab_size, (args.prefix,), device=device, generator=gen)
    against = json.loads(args.against.read_text()) if args.against else None
    results = []
    for path in args.paths:
        r = time_path(model, prompt, canvas, args, path)
        if against is not None:
            r["dlmc_step_ms"], r["dlmc_mode"] = dlmc_step_ms(against)
            r["dlmc_speedup"] = r["step_ms"] / r["dlmc_step_ms"]
        results.append(r)
        tail = ("" if against is None else
                f"; dlmc ({against['precision']} experts, {r['dlmc_mode']}) "
                f"{r['dlmc_step_ms']:.3f} ms: {r['dlmc_speedup']:.1f}x faster")
        print(f"transformers {path}: step {r['step_ms']:.3f} ms (slope over "
              f"{args.steps[0]} and {args.steps[1]} steps), the rest of a call "
              f"{r['rest_ms']:.1f} ms, warm-up {r['warmup_s']:.1f} s{tail}", flush=True)
    import transformers

    report = {"shape": "tiny" if args.tiny else "diffusiongemma-26b-a4b", "canvas": canvas,
              "prefix": args.prefix, "steps": list(args.steps), "repeats": args.repeats,
              "results": results, "implementations": kernels,
              "transformers": transformers.__version__,
              "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "python": platform.python_version()}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
