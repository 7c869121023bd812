"""GET /v1/models and /v1/models/{id} (docs/PROTOCOLS.md, Endpoints)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from ds4.server.config import MODEL_ALIASES, ServerConfig
from ds4.server.errors import ApiError
from ds4.server.runtime import Runtime
from ds4.server.wire import json_response

CREATED = 1767225600
PARAMETERS = ["tools", "tool_choice", "max_tokens", "temperature", "top_p", "top_k", "min_p",
              "stop", "seed", "stream", "reasoning_effort"]


def model_card(model_id: str, config: ServerConfig) -> dict:
    """One model object; every alias is the same weights with another thinking default."""
    ctx = config.ctx
    return {"id": model_id, "object": "model", "created": CREATED, "owned_by": "ds4",
            "name": "DeepSeek V4 Flash", "context_length": ctx,
            "top_provider": {"context_length": ctx,
                             "max_completion_tokens": min(config.tokens, ctx),
                             "is_moderated": False},
            "supported_parameters": PARAMETERS}


async def list_models(request: Request, runtime: Runtime) -> Response:
    """All ids this server answers to."""
    data = [model_card(m, runtime.config) for m in MODEL_ALIASES]
    return json_response({"object": "list", "data": data})


async def get_model(request: Request, runtime: Runtime) -> Response:
    """One model, or a 404 for ids we do not serve."""
    model_id = request.path_params["model_id"]
    if model_id not in MODEL_ALIASES:
        raise ApiError(404, f"The model '{model_id}' does not exist", param="model",
                       code="model_not_found")
    return json_response(model_card(model_id, runtime.config))
