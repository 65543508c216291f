"""The K/V layout choice (`dlmc.kv.layout`), as a decoder makes it."""

import pytest
import torch

from dlmc.engine.block_decoder import BlockDecoder
from dlmc.errors import ConfigError
from tests.engine.scripted import EOS, MASK, ScriptedModel


def test_kv_layout_choice_and_errors():
    model = ScriptedModel(lambda i, t: None)

    def decoder(**kw):
        return BlockDecoder(model, MASK, EOS, 64, torch.device("cpu"), torch.bfloat16, **kw)

    assert not decoder(mode="compile").paged  # auto: the paged cache needs CUDA to compile
    assert decoder(mode="eager", kv_layout="paged").paged  # eager attends with the reference
    assert decoder(mode="eager", kv_cache_dtype="fp8").paged
    with pytest.raises(ConfigError, match="kv_layout='ring'"):
        decoder(kv_layout="ring")
    with pytest.raises(ConfigError, match="kv_layout 'paged' with mode 'compile' needs a CUDA"):
        decoder(mode="compile", kv_layout="paged")
    with pytest.raises(ConfigError, match="kv_layout 'dense' holds bf16 K/V only"):
        decoder(mode="eager", kv_cache_dtype="fp8", kv_layout="dense")
    fp32 = BlockDecoder(model, MASK, EOS, 64, torch.device("cpu"), torch.float32, mode="eager")
    assert not fp32.paged
