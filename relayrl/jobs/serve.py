"""`relayrl serve`: an OpenAI-compatible endpoint on a model directory (or .gguf file), standalone (evaluation, an
agent developed against it). Binds 127.0.0.1 unless told otherwise; off loopback a token is required, checked
before the model loads.

Sampling stops at every end-of-sequence id of the model (generation_config.json's included), as `relayrl generate`.

Like the rest of relayrl.jobs, it may import every layer below the CLI; it must never import relayrl.cli.
"""

from __future__ import annotations

from pathlib import Path

from relayrl.engine import LLMEngine
from relayrl.errors import ConfigError
from relayrl.jobs.base_model import resolve_model
from relayrl.models.hf_io import generation_eos_ids
from relayrl.single_controller.process_setup import configure_process


def _serve_modules():
    try:  # starlette and uvicorn: only where the endpoint is wanted (the serve extra)
        from relayrl.serve import app, server
    except ModuleNotFoundError as e:
        raise ConfigError(f"relayrl serve needs the serve extra ({e.name} is not installed): "
                          "pip install 'relayrl[serve]'") from None
    return app, server


def build_endpoint(model: str, name: str | None = None, token: str | None = None, max_n: int = 16):
    """The Endpoint (relayrl.serve.app) over an engine on `model`, not started."""
    Endpoint = _serve_modules()[0].Endpoint

    model_dir = resolve_model(model)  # no tokenizer: one line; a GGUF file: converted once into the cache
    configure_process()  # this process runs the model: its CPU kernels (relayrl.parallel.cpu_kernels)
    engine = LLMEngine.from_pretrained(model_dir)
    return Endpoint(engine, name or Path(model).name, token=token, max_n=max_n,
                    stop_token_ids=generation_eos_ids(model_dir))


def serve(model: str, host: str = "127.0.0.1", port: int = 8000, token: str | None = None, name: str | None = None,
          max_n: int = 16) -> None:
    app, server = _serve_modules()
    app.check_bind(host, token)  # before anything loads: one line, at once
    server.serve_forever(build_endpoint(model, name, token, max_n), host, port)
