import pytest

from dlmc.errors import ModelNotFoundError
from dlmc.loading.hub import resolve_model


def test_offline_uncached_repo_says_what_to_download(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(
        ModelNotFoundError, match=r"yifanyu/LLaDA2.1-mini-ORL.*HF_HUB_OFFLINE=1.*hf download"
    ):
        resolve_model("yifanyu/LLaDA2.1-mini-ORL")


def test_local_paths(tmp_path):
    assert resolve_model(tmp_path) == tmp_path
    with pytest.raises(ModelNotFoundError, match="no such directory"):
        resolve_model(str(tmp_path / "nope" / "deeper"))
    (tmp_path / "f").write_text("x")
    with pytest.raises(ModelNotFoundError, match="expected a checkpoint directory"):
        resolve_model(tmp_path / "f")


def test_builtin_tiny_is_created_once(tmp_path, monkeypatch):
    monkeypatch.setenv("DLMC_CACHE", str(tmp_path))
    first = resolve_model("tiny-llada2")
    assert (first / ".complete").is_file() and (first / "tokenizer.json").is_file()
    stamp = (first / "config.json").stat().st_mtime_ns
    assert resolve_model("tiny-llada2") == first
    assert (first / "config.json").stat().st_mtime_ns == stamp
