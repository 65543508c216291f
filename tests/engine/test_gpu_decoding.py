import pytest
import torch


@pytest.mark.gpu
def test_cuda_cached_equals_uncached_and_matches_cpu(tiny_dir):
    from dlmc import LLM

    gpu = LLM(tiny_dir, device="cuda", dtype="fp32")
    kwargs = dict(prompt_token_ids=list(range(50, 90)), max_new_tokens=48)
    cached = gpu.generate(**kwargs)
    uncached = gpu.generate(**kwargs, use_cache=False)
    assert cached.token_ids == uncached.token_ids
    cpu_logits = LLM(tiny_dir, device="cpu", dtype="fp32").logits(list(range(70)))
    torch.testing.assert_close(gpu.logits(list(range(70))).cpu(), cpu_logits, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
def test_cuda_bf16_generates(tiny_dir):
    from dlmc import LLM

    llm = LLM(tiny_dir, device="cuda")
    assert llm.dtype == torch.bfloat16
    res = llm.generate(messages=[{"role": "user", "content": "Hi"}], max_new_tokens=32)
    assert len(res.token_ids) == 32 and res.num_forwards > 0
