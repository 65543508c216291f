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


def _cached_repo(hub, repo_id: str, refs: dict[str, str]):
    """A Hugging Face cache entry of `repo_id`: a snapshot per commit, `refs` naming them."""
    root = hub / ("models--" + repo_id.replace("/", "--"))
    for ref, commit in refs.items():
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / ref).write_text(commit)
        snapshot = root / "snapshots" / commit
        snapshot.mkdir(parents=True, exist_ok=True)
        (snapshot / "config.json").write_text(f'{{"ref": "{ref}"}}')
    return root


def test_revisions_resolve_from_the_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # read at import
    main, tagged = "a" * 40, "b" * 40
    root = _cached_repo(tmp_path / "hub", "acme/dlm", {"main": main, "v1": tagged})
    assert resolve_model("acme/dlm") == root / "snapshots" / main
    assert resolve_model("acme/dlm", revision="v1") == root / "snapshots" / tagged
    assert resolve_model("acme/dlm", revision=tagged) == root / "snapshots" / tagged
    with pytest.raises(ModelNotFoundError,
                       match=r"acme/dlm --revision v2: not in the local .*hf download acme/dlm "
                             r"--revision v2"):
        resolve_model("acme/dlm", revision="v2")


def test_revision_of_a_local_or_builtin_model_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("DLMC_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match=r"--revision v1: .*is a local path"):
        resolve_model(tmp_path, revision="v1")
    with pytest.raises(ModelNotFoundError, match=r"--revision v1: .*is a built-in model"):
        resolve_model("tiny-llada2", revision="v1")
    with pytest.raises(ModelNotFoundError, match=r"--revision ' ': expected a branch"):
        resolve_model("acme/dlm", revision=" ")


def test_a_revision_the_hub_lacks_is_named(monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import RevisionNotFoundError

    seen = {}

    def missing(repo_id, revision=None, **kwargs):
        seen.update(repo_id=repo_id, revision=revision)
        error = RevisionNotFoundError.__new__(RevisionNotFoundError)  # as raised on a 404
        Exception.__init__(error, "404 Client Error: Revision Not Found")
        raise error

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", missing)
    with pytest.raises(ModelNotFoundError, match=r"acme/dlm: the Hub repo has no branch, tag or "
                                                 r"commit 'nope' \(--revision\)"):
        resolve_model("acme/dlm", revision="nope")
    assert seen == {"repo_id": "acme/dlm", "revision": "nope"}
