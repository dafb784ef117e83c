"""The HTTP frontend (Starlette): routes and the small endpoints.

Protocol mapping lives in its own modules, all over one request pipeline
(``pipeline.py``) and one handler (``handler.py``): OpenAI Chat Completions and
Completions (``chat.py``), OpenAI Responses (``responses.py``), Anthropic Messages
(``messages.py``); their request bodies are typed in ``protocol*.py``.
Every failure before a response starts is an HTTP error in the protocol's
envelope; a failure after SSE headers ends the stream with the protocol's error
event. Client disconnects cancel the engine requests.
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from flare.core.errors import FrontendError, NotFoundError
from flare.runtime.engine import Engine
from flare.server.chat import ChatCompletions, Completions
from flare.server.http import Context, ServerConfig, error_response, guarded
from flare.server.messages import Messages
from flare.server.responses import Responses
from flare.server.served_model import ServedModel

__all__ = ["ServedModel", "ServerConfig", "create_app"]


def create_app(engine: Engine, model: ServedModel, config: ServerConfig = ServerConfig()) -> Starlette:
    ctx = Context(engine, model, config)
    m = engine.manifest

    async def models(http: HTTPRequest) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": model.served_name, "object": "model", "created": int(engine.started_wall), "owned_by": "flare",
            "max_model_len": m.capacities.context_limit,
        }]})

    async def health(http: HTTPRequest) -> Response:
        """Worker readiness, not process liveness: 503 while starting, draining or failed."""
        if engine.ready:
            return JSONResponse({"status": "ok"})
        detail = {"status": engine.state.value}
        if engine.failure is not None:
            detail["error"] = str(engine.failure)
        return JSONResponse(detail, status_code=503)

    async def metrics(http: HTTPRequest) -> Response:
        gauges = {**engine.gauges(), "flare_grammar_compiles_total": model.grammars.compiles}
        return Response(engine.metrics.render(gauges), media_type="text/plain; version=0.0.4")

    routes = [
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/chat/completions", guarded(ctx, ChatCompletions(ctx)), methods=["POST"]),
        Route("/v1/completions", guarded(ctx, Completions(ctx)), methods=["POST"]),
        Route("/v1/responses", guarded(ctx, Responses(ctx)), methods=["POST"]),
        Route("/v1/messages", guarded(ctx, Messages(ctx)), methods=["POST"]),
        Route("/v1/models", guarded(ctx, models), methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]

    async def not_found(http: HTTPRequest, exc) -> Response:
        return error_response(NotFoundError(f"no route {http.method} {http.url.path}", code="route_not_found"))

    async def method_not_allowed(http: HTTPRequest, exc) -> Response:
        err = FrontendError(f"method {http.method} is not allowed on {http.url.path}", code="method_not_allowed")
        err.status = 405
        return error_response(err)

    return Starlette(routes=routes, exception_handlers={404: not_found, 405: method_not_allowed})
