"""What the server's endpoints share (`ServerContext`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dlmc.server.engine_worker import EngineWorker
from dlmc.server.handling import RequestPreparer

__all__ = ["ServerContext"]


@dataclass(frozen=True)
class ServerContext:
    """What the endpoints share."""

    llm: Any
    worker: EngineWorker
    preparer: RequestPreparer
    model_name: str
    created: int  # unix time the server started (OpenAI `created` of the model)
    max_body_bytes: int  # larger request bodies are answered 413
