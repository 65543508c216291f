"""Resolve `--model` to a local checkpoint directory: built-in id, local path or Hub repo id."""

from __future__ import annotations

import os
from pathlib import Path

from dlmc.errors import ModelNotFoundError

# Files dlmc reads from a checkpoint; anything else in a repo (e.g. .pth copies) is not fetched.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt", "*.py"]


def resolve_model(model: str | os.PathLike[str], revision: str | None = None) -> Path:
    """A local directory, a built-in id (`tiny-llada2`, `tiny-llada2-nvfp4`,
    `tiny-diffusiongemma`, `tiny-diffusiongemma-nvfp4`) or a Hub repo id, at `revision` (a
    branch, tag or commit of a Hub repo; default its main branch).

    Hub repos are downloaded with a progress bar into the Hugging Face cache (reused after);
    offline (`HF_HUB_OFFLINE=1` or no network) an uncached repo is a clear error.
    """
    from dlmc.loading.tiny import BUILTIN_MODELS, ensure_builtin

    name = os.fspath(model)
    if revision is not None and (not isinstance(revision, str) or not revision.strip()):
        raise ModelNotFoundError(f"--revision {revision!r}: expected a branch, tag or commit")
    path = Path(name).expanduser()
    if revision is not None and (name in BUILTIN_MODELS or path.exists()):
        kind = "a built-in model" if name in BUILTIN_MODELS else "a local path"
        raise ModelNotFoundError(
            f"--revision {revision}: only a Hugging Face repo id has revisions, and --model "
            f"{name} is {kind}")
    if name in BUILTIN_MODELS:
        return ensure_builtin(name)
    if path.is_dir():
        return path
    if path.exists():
        raise ModelNotFoundError(f"--model {name}: expected a checkpoint directory, got a file")
    if name.count("/") != 1 or name.startswith((".", "/")):
        raise ModelNotFoundError(
            f"--model {name}: no such directory, and not a Hugging Face repo id (owner/name) or a "
            f"built-in model ({', '.join(BUILTIN_MODELS)})"
        )
    return _download(name, revision)


def _download(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HFValidationError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    at = "" if revision is None else f" --revision {revision}"
    advice = (
        f"download it where there is network with `hf download {repo_id}{at}` (it lands in the "
        "Hugging Face cache, which dlmc reads), or pass a local checkpoint directory"
    )
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS,
                                      local_files_only=offline))
    except RevisionNotFoundError:
        raise ModelNotFoundError(
            f"--model {repo_id}: the Hub repo has no branch, tag or commit {revision!r} "
            "(--revision)") from None
    except (RepositoryNotFoundError, HFValidationError) as exc:
        raise ModelNotFoundError(
            f"--model {repo_id}: not found on the Hugging Face Hub ({exc})"
        ) from None
    except (
        Exception
    ) as exc:  # offline, no network, cache miss: huggingface_hub raises several types
        where = "HF_HUB_OFFLINE=1 is set" if offline else "the Hub could not be reached"
        raise ModelNotFoundError(
            f"--model {repo_id}{at}: not in the local Hugging Face cache and {where} "
            f"({type(exc).__name__}); {advice}"
        ) from None
