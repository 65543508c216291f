"""The compile site: Inductor's options and cache directory follow the `KernelConfig`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dlmc.custom_ops.kernel_config import DEFAULT_KERNELS, KernelConfig
from dlmc.errors import ConfigError
from dlmc.graphs import compile as compile_site
from dlmc.graphs.compile import compile_options, compiled, inductor_cache_dir


def test_compile_options_follow_the_kernel_config(monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_ENABLE_PDL", raising=False)
    assert compile_options() == {"triton.enable_pdl": True}
    assert compile_options(KernelConfig(pdl=False)) == {"triton.enable_pdl": False}
    options = compile_options(KernelConfig(deterministic_compile=True, split_reductions="off"))
    assert options == {"triton.enable_pdl": True, "deterministic": True,
                       "split_reductions": False}
    # "auto": off for DiffusionGemma's compiles (`canvas`), Inductor's default elsewhere
    assert compile_options(canvas=True) == {"triton.enable_pdl": True, "split_reductions": False}
    assert compile_options(KernelConfig(split_reductions="on"), canvas=True) == {
        "triton.enable_pdl": True}
    assert "split_reductions" in compile_options(KernelConfig(split_reductions="off"))
    # every option is one this torch's Inductor has (a dotted name: a sub-config's field)
    for name in options:
        config = torch._inductor.config
        *parents, field = name.split(".")
        for parent in parents:
            config = getattr(config, parent)
        assert hasattr(config, field), name
    monkeypatch.setenv("TORCHINDUCTOR_ENABLE_PDL", "1")  # the user's own switch stands
    assert compile_options(KernelConfig(pdl=False)) == {}


def test_kernel_config_is_validated_and_recorded():
    with pytest.raises(ConfigError, match="attention_backend='flash'.*auto, triton, reference"):
        KernelConfig(attention_backend="flash")
    with pytest.raises(ConfigError, match="KernelConfig.pdl='yes'"):
        KernelConfig(pdl="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="KernelConfig.deterministic_compile=1"):
        KernelConfig(deterministic_compile=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="split_reductions=False: expected one of auto, on"):
        KernelConfig(split_reductions=False)  # type: ignore[arg-type]
    with pytest.raises(ConfigError,
                       match="KernelConfig.gemma_bf16_experts='cutlass'.*auto, grouped_mm, triton"):
        KernelConfig(gemma_bf16_experts="cutlass")
    with pytest.raises(ConfigError,
                       match="KernelConfig.gemma_attention='sdpa'.*auto, torch, triton"):
        KernelConfig(gemma_attention="sdpa")
    with pytest.raises(ConfigError,
                       match="KernelConfig.gemma_sampler='cuda'.*auto, torch, triton"):
        KernelConfig(gemma_sampler="cuda")
    config = KernelConfig(attention_backend="reference", pdl=False)
    assert config.to_dict() == {"attention_backend": "reference", "pdl": False,
                                "deterministic_compile": False,
                                "gemma_bf16_experts": "auto", "gemma_attention": "auto",
                                "gemma_sampler": "auto", "gemma_fused_projections": True,
                                "fused_post_attention_norm": True,
                                "nvfp4_pad_experts": True, "nvfp4_tiles": "",
                                "split_reductions": "auto"}
    assert config.describe() == ("attention_backend=reference pdl=False "
                                 "deterministic_compile=False "
                                 "gemma_bf16_experts=auto gemma_attention=auto "
                                 "gemma_sampler=auto gemma_fused_projections=True "
                                 "fused_post_attention_norm=True nvfp4_pad_experts=True "
                                 "nvfp4_tiles= split_reductions=auto")
    assert config.cache_tag() == KernelConfig(attention_backend="reference",
                                              pdl=False).cache_tag() != DEFAULT_KERNELS.cache_tag()
    assert KernelConfig(nvfp4_pad_experts=False).cache_tag() != DEFAULT_KERNELS.cache_tag()
    assert KernelConfig(split_reductions="on").cache_tag() != DEFAULT_KERNELS.cache_tag()
    with pytest.raises(ConfigError, match="KernelConfig.gemma_fused_projections='yes'"):
        KernelConfig(gemma_fused_projections="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="KernelConfig.nvfp4_pad_experts='yes'"):
        KernelConfig(nvfp4_pad_experts="yes")  # type: ignore[arg-type]
    assert KernelConfig(nvfp4_tiles="block_m=32").cache_tag() != DEFAULT_KERNELS.cache_tag()
    with pytest.raises(ConfigError, match=r"nvfp4_tiles='block_m=48': NVFP4Tiles.block_m=48"):
        KernelConfig(nvfp4_tiles="block_m=48")
    with pytest.raises(ConfigError, match="nvfp4_tiles='rows=32'.*name among block_m"):
        KernelConfig(nvfp4_tiles="rows=32")
    assert (KernelConfig(gemma_bf16_experts="triton").cache_tag()
            != KernelConfig(gemma_attention="triton").cache_tag() != DEFAULT_KERNELS.cache_tag())


def test_inductor_cache_dir_is_per_kernel_config(monkeypatch, tmp_path):
    """Configs that change the code inside dlmc's ops get their own Inductor cache."""
    monkeypatch.setenv("DLMC_CACHE", str(tmp_path))
    monkeypatch.setattr(compile_site, "USER_INDUCTOR_CACHE_DIR", None)  # the user's: none
    dirs = []
    for config in (DEFAULT_KERNELS, KernelConfig(pdl=False),
                   KernelConfig(deterministic_compile=True), KernelConfig(pdl=False)):
        # set by Inductor itself to its default: not the user's choice, replaced
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_default")
        dirs.append(inductor_cache_dir(config))
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == dirs[-1]
        assert dirs[-1].startswith(str(tmp_path))
    assert dirs[0] == str(tmp_path / "inductor") and len(set(dirs)) == 3 and dirs[1] == dirs[3]
    monkeypatch.setattr(compile_site, "USER_INDUCTOR_CACHE_DIR", "/elsewhere")
    assert inductor_cache_dir() == "/elsewhere" == os.environ["TORCHINDUCTOR_CACHE_DIR"]


def test_one_compiled_function_per_name_and_config(monkeypatch, tmp_path):
    """(The runner's tests run compiled rounds; here only which function is whose.)"""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_site, "USER_INDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_site, "_compiled", {})

    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    first = compiled("double", double)
    assert compiled("double", double) is first
    assert compiled("double", double, KernelConfig(pdl=False)) is not first


_IMPORT_COMPILE = """
import os, sys
import dlmc.graphs.compile as compile_site
print(repr(compile_site.USER_INDUCTOR_CACHE_DIR))
os.environ["DLMC_CACHE"] = sys.argv[1]
print(compile_site.inductor_cache_dir())
"""


@pytest.mark.parametrize("user_dir", [None, "elsewhere"])
def test_a_fresh_process_tells_the_users_cache_dir_from_inductors_default(tmp_path, user_dir):
    """Importing torch._dynamo sets TORCHINDUCTOR_CACHE_DIR to Inductor's default before the
    compile site reads it: unset by the user, the process still gets dlmc's directory."""
    env = {k: v for k, v in os.environ.items()
           if k != "TORCHINDUCTOR_CACHE_DIR" and not k.startswith("DLMC_")}
    if user_dir:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / user_dir)
    proc = subprocess.run([sys.executable, "-c", _IMPORT_COMPILE, str(tmp_path / "dlmc")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen, used = proc.stdout.strip().splitlines()[-2:]
    if user_dir:
        assert seen == repr(str(tmp_path / user_dir)) and used == str(tmp_path / user_dir)
    else:
        assert seen == "None" and used == str(tmp_path / "dlmc" / "inductor")
