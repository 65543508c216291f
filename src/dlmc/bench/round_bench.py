"""`dlmc bench round`: time one denoising round eager, compiled and graph-replayed, with the
bytes the actual routing touched, the achieved GB/s and the copy bandwidth of the same run."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dlmc.bench.timing import cuda_times, drain, queued_cuda_times
from dlmc.custom_ops.kernel_config import DEFAULT_KERNELS, KernelConfig
from dlmc.engine.decode_config import DecodeConfig
from dlmc.graphs.in_flight import block_in_flight
from dlmc.graphs.round import EDITS_OFF
from dlmc.graphs.runner import RoundRunner
from dlmc.kv.dense_cache import DenseKVCache
from dlmc.models.moe import MoEBlock


@dataclass(frozen=True)
class RoundBenchConfig:
    block_length: int = 32
    prefix: int = 1024
    routing: str = "uniform"  # "uniform" | "model"
    rounds: int = 100
    modes: tuple[str, ...] = ("eager", "compile", "graph")
    seed: int = 0
    temperature: float = 0.0  # > 0: sampled rounds (seeded generator), else greedy
    kernels: KernelConfig = DEFAULT_KERNELS  # the compile site's and the cache's choices


class FixedRouter(nn.Module):
    """Uniform routing: each token draws top-k distinct experts uniformly (seeded, fixed).

    `forward` gives the fixed ids and weights. The model's own router still runs every round,
    through `real_weights`, which `UniformRoutingMoE` calls.
    """

    def __init__(self, router: nn.Module, num_experts: int, top_k: int, max_tokens: int,
                 scale: float, device: torch.device, gen: torch.Generator) -> None:
        super().__init__()
        self.router, self.num_experts = router, num_experts
        keys = torch.rand(max_tokens, num_experts, device=device, generator=gen)
        self.register_buffer("ids", keys.topk(top_k, dim=-1).indices)  # [T, K]
        weights = torch.rand(max_tokens, top_k, device=device, generator=gen)
        self.register_buffer("weights", weights / weights.sum(-1, keepdim=True) * scale)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = x.shape[0]
        return self.ids[:tokens], self.weights[:tokens]

    def real_weights(self, x: torch.Tensor) -> torch.Tensor:
        """The model's router on `x` (its launches); its weights `[T, K]`."""
        return self.router(x)[1]


class UniformRoutingMoE(nn.Module):
    """A MoE block with a `FixedRouter` whose model router still runs every round: the block's
    output plus `0 * w` of one real routing weight `w` (0 * x is not 0 for inf/NaN, so no
    compiler removes the router's work). The scalar enters the next layer's residual-add +
    RMSNorm kernel, so the round has the model's launches and no more (adding `0 * w` to the
    fixed weights instead costs a pointwise launch of its own per layer)."""

    def __init__(self, block: MoEBlock) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        real = self.block.gate.real_weights(x)  # [T, K]
        out = self.block(x)  # [T, H]
        return out + 0.0 * real[:1, :1].to(out.dtype)

    @property
    def router_weight(self) -> torch.Tensor:
        """The model router's weight (`MoEBlock.router_weight`)."""
        return self.block.gate.router.weight

    def routed(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """`forward` with the model router's logits computed by the caller
        (`MoEBlock.routed`): the model's routing runs on them, the fixed routing is used."""
        real = self.block.gate.router.route(logits, x.is_cuda)[1]  # [T, K]
        out = self.block.routed_by(x, *self.block.gate(x))  # [T, H]
        return out + 0.0 * real[:1, :1].to(out.dtype)


def use_uniform_routing(model: nn.Module, max_tokens: int, seed: int) -> None:
    """Every MoE block's router becomes a `FixedRouter` (uniform routing); the block is wrapped
    in a `UniformRoutingMoE`, which keeps the model's router running."""
    cfg = model.config
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for layer in list(model.modules()):
        block = getattr(layer, "mlp", None)
        if isinstance(block, MoEBlock):
            device = block.gate.weight.device
            block.gate = FixedRouter(block.gate, cfg.num_experts, cfg.num_experts_per_tok,
                                     max_tokens, cfg.routed_scaling_factor, device, gen)
            layer.mlp = UniformRoutingMoE(block)


def touched_bytes(model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor,
                  prefix: int, kv_bytes: int = 2) -> tuple[int, float]:
    """Bytes one round reads (weights used, touched experts, embedding rows, KV) and the mean
    number of distinct routed experts per MoE layer, from one forward's actual routing. A
    shared expert fused into the routed experts (`fuse_shared_experts`) counts as one more
    touched expert of its layer (or, beside NVFP4 experts, as its BF16 weights): the same bytes
    as when it is a module of its own."""
    cfg = model.config
    counts: list[int] = []  # the ids the experts get, whichever router path made them
    hooks = [m.experts.register_forward_pre_hook(lambda _m, args: counts.append(
        int(args[1].unique().numel()))) for m in model.modules() if isinstance(m, MoEBlock)]
    from dlmc.kv.attention import CachedAttention

    scratch = DenseKVCache(cfg.num_hidden_layers, prefix + tokens.numel(),
                           cfg.num_key_value_heads, cfg.head_dim, torch.bfloat16, tokens.device)
    with torch.inference_mode():
        model(tokens, positions, CachedAttention(scratch, prefix, store=False))
    for hook in hooks:
        hook.remove()
    total = 0
    storages: set[int] = set()  # a fused weight and its views (tied weights) count once
    # Buffers too: the fp32 router weight is one (a FixedRouter's whole table counts: a few KB).
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        size = tensor.numel() * tensor.element_size()
        storage = tensor.untyped_storage().data_ptr()
        if ".experts." in name or (storage and storage in storages):
            continue
        storages.add(storage or id(tensor))  # (no data pointer: meta tensors)
        if name.endswith("word_embeddings.weight"):
            size = tokens.numel() * tensor.shape[1] * tensor.element_size()
        total += size
    mean_experts = statistics.mean(counts) if counts else 0.0
    moe_blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    for module, count in zip(moe_blocks, counts, strict=True):
        tensors = [*module.experts.named_parameters(), *module.experts.named_buffers()]
        # a shared expert kept beside packed experts (NVFP4Experts.set_shared_expert): whole
        shared = sum(t.numel() * t.element_size() for n, t in tensors if n.startswith("shared_"))
        per_expert = sum(t[0].numel() * t.element_size() for n, t in tensors
                         if not n.startswith("shared_"))
        stacked_shared = module.shared_expert_id is not None and not shared  # BF16Experts row E
        total += per_expert * (count + stacked_shared) + shared
    kv = cfg.num_hidden_layers * 2 * (prefix + tokens.numel()) * cfg.num_key_value_heads
    total += kv * cfg.head_dim * kv_bytes
    return total, mean_experts


def time_rounds(model: nn.Module, cache: Any, bench: RoundBenchConfig, mode: str,
                mask_id: int) -> dict[str, Any]:
    """Median / min / max ms of `bench.rounds` rounds in `mode`, after warm-up."""
    device = cache.device
    bl, start = bench.block_length, bench.prefix
    runner = RoundRunner(model, cache, bl, mask_id, mode, bench.kernels)
    gen = torch.Generator(device=device).manual_seed(bench.seed)
    cfg = DecodeConfig(block_length=bl, max_new_tokens=bl)
    buf = runner.buf
    buf.tokens.copy_(torch.randint(0, model.config.vocab_size - 1, (bl,), device=device,
                                   generator=gen))
    buf.positions.copy_(torch.arange(start, start + bl, device=device))
    buf.editable.fill_(True)
    buf.threshold.fill_(cfg.threshold)
    buf.edit_threshold.fill_(cfg.edit_threshold)
    buf.max_post.fill_(1 << 20)
    key_len = runner.key_len(start + bl)
    sampling = None
    if bench.temperature > 0:
        sampler = torch.Generator(device=device).manual_seed(bench.seed + 1)
        sampling = (bench.temperature, None, None, sampler)
    started = time.perf_counter()
    for _ in range(3):
        runner.step("joint", key_len, sampling)
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - started
    times = cuda_times(lambda: runner.step("joint", key_len, sampling), bench.rounds)
    result = {"mode": mode, "median_ms": statistics.median(times), "min_ms": min(times),
              "max_ms": max(times), "warmup_s": warmup_s, "compile_capture_s": runner.compile_s,
              "key_len": key_len, "rounds": bench.rounds, "temperature": bench.temperature}
    if mode == "graph":  # the replays alone, queued back to back: the device's time per round
        queued = queued_cuda_times(lambda: runner.launch("joint", key_len, sampling),
                                   bench.rounds)
        result.update(queued_median_ms=statistics.median(queued), queued_min_ms=min(queued),
                      queued_max_ms=max(queued))
        if sampling is None:  # the decode loop's pattern: a round queued ahead (greedy)
            flight = in_flight_times(runner, key_len, bench.rounds, mask_id)
            result.update(in_flight_median_ms=statistics.median(flight),
                          in_flight_min_ms=min(flight), in_flight_max_ms=max(flight))
    return result


def in_flight_times(runner: RoundRunner, key_len: int, rounds: int, mask_id: int
                    ) -> list[float]:
    """Milliseconds per round as the decode loop runs greedy rounds (`lookahead`,
    `dlmc.graphs.in_flight.block_in_flight`): whole blocks from all masks, no commit threshold
    met (one commit per round) and one post-fill round allowed, so each block runs its
    `block_length` filling rounds one ahead of the host's reads and its last round or two
    read one by one. CUDA events after consecutive launches give the device time from one
    round's end to the next's, launch gaps included (wall clock without a GPU: CPU smoke
    tests); blocks repeat until `rounds` times are taken."""
    buf = runner.buf
    cuda = buf.done.is_cuda
    times: list[float] = []
    stamps: list[Any] = []  # after each launch of the current block

    def stamp() -> None:
        if cuda:
            stamps.append(torch.cuda.Event(enable_timing=True))
            stamps[-1].record()
        else:
            stamps.append(time.perf_counter())

    while len(times) < rounds:
        buf.tokens.fill_(mask_id)
        buf.threshold.fill_(EDITS_OFF)
        buf.max_post.fill_(1)
        for counter in (buf.step, buf.post):
            counter.zero_()
        stamps.clear()
        n, _ = block_in_flight(runner.flag_reads, lambda: runner.launch("joint", key_len),
                               lambda: runner.launch("joint", key_len), True,
                               after_launch=stamp)
        if len(stamps) != n or n < 2:
            raise RuntimeError(f"in-flight timing: {len(stamps)} launches for {n} rounds")
        times += [a.elapsed_time(b) if cuda else (b - a) * 1e3
                  for a, b in zip(stamps, stamps[1:], strict=False)]
    return times[:rounds]


def loop_overhead(model: nn.Module, bench: RoundBenchConfig, mask_id: int, round_ms: float,
                  blocks: int = 4, kv_cache_dtype: str = "bf16",
                  refresh: str = "fused", mode: str = "graph",
                  kv_layout: str = "auto", lookahead: bool = True) -> dict[str, Any]:
    """Wall time of a whole graph-mode decode (prefill + `blocks` blocks) against the sum of
    its forwards: rounds at `round_ms` (the caller's median for this loop's pattern), fused
    rounds (a round + the previous block's refresh, 2 blocks), prefill chunks (the decoder's
    chunk of up to 512 tokens) and separate refreshes (one block) timed here."""
    from dlmc.engine.block_decoder import BlockDecoder, prefill_chunk

    device = next(model.parameters()).device
    bl = bench.block_length
    decoder = BlockDecoder(model, mask_id, -1, bench.prefix + (blocks + 1) * bl + 1024, device,
                           torch.bfloat16, mode=mode, kv_cache_dtype=kv_cache_dtype,
                           refresh=refresh, kv_layout=kv_layout, lookahead=lookahead,
                           kernels=bench.kernels)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gen = torch.Generator(device="cpu").manual_seed(bench.seed)
    prompt = torch.randint(0, model.config.vocab_size - 1, (bench.prefix,), generator=gen)
    cfg = DecodeConfig(block_length=bl, max_new_tokens=blocks * bl)

    def run() -> Any:
        return drain(decoder.decode(prompt.tolist(), cfg))

    run()  # captures prefill / refresh / round graphs
    sync()
    started = time.perf_counter()
    out = run()
    sync()
    wall_ms = (time.perf_counter() - started) * 1e3
    runner = decoder.runner(bl)
    tokens = torch.randint(0, 100, (bl,), device=device)
    positions = torch.arange(bench.prefix, bench.prefix + bl, device=device)
    if decoder.paged:  # fills append at the committed length: put it at the prefix
        decoder.cache.reset()
        decoder.cache.advance(bench.prefix)
    fill_key = runner.key_len(bench.prefix + bl)
    fill_ms = statistics.median(cuda_times(lambda: runner.fill(tokens, positions, fill_key), 20))
    chunk = prefill_chunk(bl)
    prefill_chunks = -(-(bench.prefix // bl * bl) // chunk)
    prefill_ms = 0.0
    if prefill_chunks:  # a chunk at the prompt's start, as the first of a decode
        if decoder.paged:
            decoder.cache.reset()
        ids = torch.randint(0, 100, (chunk,), device=device)
        at = torch.arange(chunk, device=device)
        prefill_ms = statistics.median(
            cuda_times(lambda: runner.fill(ids, at, runner.key_len(chunk)), 10))
    fused_ms = 0.0
    if out.fused_rounds:  # block at prefix + bl, carrying the refresh of the block at prefix
        fused_key = runner.key_len(bench.prefix + 2 * bl)
        runner.prev_tokens.copy_(tokens)
        runner.prev_positions.copy_(positions)
        runner.buf.positions.copy_(positions + bl)
        fused_ms = statistics.median(
            cuda_times(lambda: runner.step_fused(cfg.algorithm, fused_key), 20))
    fills = out.total_forwards - out.num_forwards - prefill_chunks  # separate refreshes
    plain = out.num_forwards - out.fused_rounds
    busy_ms = (plain * round_ms + out.fused_rounds * fused_ms + prefill_chunks * prefill_ms
               + fills * fill_ms)
    return {"refresh": refresh, "lookahead": decoder.lookahead, "wall_ms": wall_ms,
            "rounds": out.num_forwards, "round_ms": round_ms,
            "fused_rounds": out.fused_rounds, "fused_round_ms_median": fused_ms,
            "prefill_chunks": prefill_chunks, "prefill_chunk_tokens": chunk,
            "prefill_ms_median": prefill_ms,
            "fill_forwards": fills, "fill_ms_median": fill_ms, "sum_of_forwards_ms": busy_ms,
            "overhead_ratio": wall_ms / busy_ms - 1.0, "blocks": blocks}


def profile_rounds(model: nn.Module, cache: Any, bench: RoundBenchConfig,
                   mask_id: int, rounds: int = 10) -> str:
    """Per-kernel CUDA time of compiled (not graph-captured) rounds, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    runner = RoundRunner(model, cache, bench.block_length, mask_id, "compile", bench.kernels)
    buf = runner.buf
    buf.positions.copy_(torch.arange(bench.prefix, bench.prefix + bench.block_length,
                                     device=cache.device))
    buf.editable.fill_(True)
    buf.max_post.fill_(1 << 20)
    key_len = runner.key_len(bench.prefix + bench.block_length)
    for _ in range(3):
        runner.step("joint", key_len)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 record_shapes=True) as prof:
        for _ in range(rounds):
            runner.step("joint", key_len)
        torch.cuda.synchronize()
    averages = prof.key_averages()
    kernels = averages.table(sort_by="self_cuda_time_total", row_limit=60,
                             max_name_column_width=70)
    launches = launch_line(averages, rounds, len(model.model.layers))
    # Which matmul is which kernel: the aten calls that launch them, by input shape.
    by_shape = prof.key_averages(group_by_input_shape=True)
    matmuls = [e for e in by_shape if e.key in ("aten::mm", "aten::addmm", "aten::bmm")]
    lines = [f"{e.key} {e.input_shapes} calls={e.count} "
             f"cuda_us_per_call={e.device_time_total / max(e.count, 1):.2f}" for e in matmuls]
    return f"{kernels}\n{launches}\nmatmuls per {rounds} rounds:\n" + "\n".join(lines)


def launch_line(averages: Any, rounds: int, layers: int) -> str:
    """Device launches (kernels, copies, sets: the profiler's rows with device time of their
    own) per round and per layer, from `key_averages()` rows of `rounds` profiled rounds. The
    per-layer figure divides the whole round's count, its launches outside the layers (the
    embedding, the final norm, the lm_head, the decision) included."""
    if rounds < 1 or layers < 1:
        raise ValueError(f"launch_line: rounds and layers must be >= 1, got {rounds}, {layers}")
    total = sum(e.count for e in averages if e.self_device_time_total > 0)
    per_round = total / rounds
    return (f"device launches per round: {per_round:.0f} = {per_round / layers:.1f} per layer "
            f"over {layers} layers (the launches outside the layers included)")
