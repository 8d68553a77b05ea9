"""The OpenAI-compatible HTTP front (aiohttp), beside the gRPC API and in front of the same Router:

    POST /v1/completions        prompt -> completion (stream: server-sent events, then `data: [DONE]`)
    POST /v1/chat/completions   only for a model with a chat template (else 400 saying so)
    GET  /v1/models             the served model
    GET  /health                200 while the verifier answers, else 503 (open without a key)
    GET  /metrics               when --metrics-port equals --http-port (open without a key)

A request is turned into the gRPC `GenerateRequest` and checked by the same `validate`, so both
APIs accept, refuse and generate alike: the same prompt and parameters give the same tokens.
Body formats and error shapes: router/openai_protocol.py. With an API key, every path but
/health and /metrics needs `Authorization: Bearer KEY` (401 otherwise).

A client that disconnects cancels its handler (handler_cancellation), and the `finally` below
tells the Router to stop the request, as the gRPC servicer does.
"""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web

from router.auth import check_bearer
from router.links import DuplicateRequest, EngineUnavailable
from router.openai_protocol import (ApiError, ChatTemplate, Parsed, chat_request, check_model, choice,
                                    completion_request, envelope, error_from_status, parse_json_body, usage)
from router.loop import Failure, Router, StreamEvent
from router.server import Limits, status_of, validate

OPEN_PATHS = ("/health", "/metrics")   # everything else needs the API key when one is set


class OpenAIFront:
    def __init__(self, router: Router, tokenizer, limits: Limits, model_name: str, *,
                 chat_template: ChatTemplate | None = None, api_key: str | None = None):
        self.router, self.tokenizer, self.limits = router, tokenizer, limits
        self.model_name, self.chat_template, self.api_key = model_name, chat_template, api_key
        self.created = int(time.time())

    def app(self, metrics_handler=None) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=self.limits.max_message_bytes)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        if metrics_handler is not None:
            app.router.add_get("/metrics", metrics_handler)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        """The API key (deny by default: only OPEN_PATHS go without), and every error as OpenAI error
        JSON."""
        try:
            if self.api_key and request.path not in OPEN_PATHS:
                reason = check_bearer(request.headers.get("Authorization"), self.api_key)
                if reason is not None:
                    raise ApiError(401, reason, code="UNAUTHENTICATED")
            return await handler(request)
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)
        except web.HTTPException as exc:  # unknown path, wrong method, body too large
            if exc.status < 400:
                raise
            return web.json_response(ApiError(exc.status, f"{exc.reason}: {request.method} {request.path}",
                                              code=exc.reason.upper().replace(" ", "_")).body(), status=exc.status)

    # ------------------------------------------------------------------ endpoints

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok" if self.router.serving else "unavailable"},
                                 status=200 if self.router.serving else 503)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "spectandem",
            "max_model_len": self.limits.max_context}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        check_model(body, self.model_name)
        parsed = completion_request(body, request.headers.get("X-Request-Id", ""))
        return await self._generate(request, parsed, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        check_model(body, self.model_name)
        if self.chat_template is None:
            raise ApiError(400, f"the model `{self.model_name}` has no chat template (no chat_template in its "
                                "tokenizer_config.json or chat_template.jinja): use /v1/completions", "messages")
        parsed = await asyncio.to_thread(chat_request, body, request.headers.get("X-Request-Id", ""),
                                         self.chat_template, self.tokenizer, self.limits.max_context,
                                         self.limits.max_prompt_chars)
        return await self._generate(request, parsed, chat=True)

    # ------------------------------------------------------------------ generation

    async def _generate(self, request: web.Request, parsed: Parsed, chat: bool) -> web.StreamResponse:
        try:
            prompt_ids, params = await validate(parsed.request, self.tokenizer, self.limits)
            req = self.router.submit(prompt_ids, params, parsed.request.request_id or None)
        except (ValueError, EngineUnavailable, DuplicateRequest) as exc:
            code, msg = status_of(exc)
            raise error_from_status(code.name, msg, parsed.prompt_param) from None
        response_id = ("chatcmpl-" if chat else "cmpl-") + req.request_id  # the id in logs and X-Request-Id
        shape = dict(chat=chat, response_id=response_id, created=int(time.time()), model=self.model_name)
        try:
            # Wait for the first event before answering, so a failure before any token still
            # gets its own HTTP status (afterwards a stream can only report it in an event).
            first = await req.events.get()
            if isinstance(first, Failure):
                raise error_from_status(first.code, first.message, parsed.prompt_param)
            if parsed.stream:
                return await self._stream(request, req, first, parsed, shape, prompt_ids)
            return await self._whole(req, first, parsed, shape, prompt_ids)
        finally:
            if not req.done:
                self.router.cancel(req)

    async def _whole(self, req, first: StreamEvent, parsed: Parsed, shape: dict, prompt_ids: list[int]) -> web.Response:
        text, token_ids, ev = "", [], first
        while True:
            if isinstance(ev, Failure):
                raise error_from_status(ev.code, ev.message, parsed.prompt_param)
            text += ev.text
            token_ids += ev.token_ids
            if ev.finish_reason is not None:
                break
            ev = await req.events.get()
        extra = dict(token_ids=token_ids, prompt_token_ids=prompt_ids) if parsed.return_token_ids else {}
        out = envelope(shape["chat"], False, shape["response_id"], shape["created"], shape["model"],
                       [choice(shape["chat"], False, text, ev.finish_reason, **extra)],
                       usage(len(prompt_ids), len(token_ids)))
        return web.json_response(out, headers={"X-Request-Id": req.request_id})

    async def _stream(self, request: web.Request, req, first: StreamEvent, parsed: Parsed, shape: dict,
                      prompt_ids: list[int]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": req.request_id})
        await resp.prepare(request)
        chat, completion_tokens, ev, sent = shape["chat"], 0, first, 0
        while True:
            if isinstance(ev, Failure):
                await _event(resp, error_from_status(ev.code, ev.message, parsed.prompt_param).body())
                break
            completion_tokens += len(ev.token_ids)
            ids = dict(token_ids=ev.token_ids) if parsed.return_token_ids else {}
            if sent == 0 and parsed.return_token_ids:
                ids["prompt_token_ids"] = prompt_ids
            if ev.text or ev.finish_reason is not None or ids or (chat and sent == 0):
                c = choice(chat, True, ev.text, ev.finish_reason, first=sent == 0, **ids)
                await _event(resp, envelope(chat, True, shape["response_id"], shape["created"], shape["model"], [c],
                                            None))
                sent += 1
            if ev.finish_reason is not None:
                if parsed.include_usage:
                    await _event(resp, envelope(chat, True, shape["response_id"], shape["created"], shape["model"],
                                                [], usage(len(prompt_ids), completion_tokens)))
                break
            ev = await req.events.get()
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def _event(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


async def _json_body(request: web.Request) -> dict:
    try:
        raw = await request.text()
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the request body is not valid UTF-8: {exc}") from None
    return parse_json_body(raw)
