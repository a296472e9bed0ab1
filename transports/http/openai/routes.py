"""The OpenAI-compatible route table (handlers in :mod:`~sessiontape.transports.http.openai.responses`,
:mod:`~sessiontape.transports.http.openai.chat`; shared parts in :mod:`~sessiontape.transports.http.openai.shared`)."""

from __future__ import annotations

from starlette.routing import BaseRoute, Route

from sessiontape.transports.http.openai.chat import ChatCompletions
from sessiontape.transports.http.openai.chat_template import load_template
from sessiontape.transports.http.openai.responses import Responses
from sessiontape.transports.http.openai.shared import Api, Handler, Models, openai_errors
from sessiontape.transports.http.openai.turns import Turns


def routes(api: Api) -> list[BaseRoute]:
    """The OpenAI-compatible routes, bound to the native API's runtime and task set."""
    models = Models(api)
    template = load_template(api.runtime.config, api.runtime.engine.info.chat)
    turns = Turns(api.runtime, template, api.background)
    resp = Responses(api, models, turns)
    chat = ChatCompletions(api, models, turns)
    table: list[tuple[str, Handler, str]] = [
        ("/v1/models", models.list, "GET"),
        ("/v1/models/{model:path}", models.get, "GET"),
        ("/v1/responses", resp.create, "POST"),
        ("/v1/responses/{rid}", resp.retrieve, "GET"),
        ("/v1/responses/{rid}/cancel", resp.cancel, "POST"),
        ("/v1/responses/{rid}/input_items", resp.input_items, "GET"),
        ("/v1/chat/completions", chat.create, "POST"),
    ]
    return [Route(path, openai_errors(fn), methods=[method]) for path, fn, method in table]
