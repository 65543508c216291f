"""`dlmc serve`: an HTTP server (FastAPI + uvicorn) with dlmc's streaming `/generate` and an
OpenAI-compatible API. `create_app(llm, settings)` builds the app around a loaded `LLM`."""

from dlmc.server.app import ServerSettings, create_app

__all__ = ["ServerSettings", "create_app"]
