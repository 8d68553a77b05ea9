"""Structured logs (`serve --log-format json`): every log record as one JSON line, and one line per
request event from a router listener, always with the request id.

Request events (logger `spectandem.requests`, level INFO), with their fields:
    admitted     prompt_tokens, max_tokens, temperature, queue_s (submit -> admission)
    first_token  ttft_s (submit -> first token)
    finished     finish_reason, completion_tokens, e2e_s, num_rounds, draft_tokens,
                 accepted_tokens, accept_length, fallback_rounds, plain_rounds
    failed       code (a gRPC status name), completion_tokens, e2e_s
    cancelled    completion_tokens, e2e_s
Later token chunks are not logged (one line per round per request would drown the rest).
Prompt and completion text are never logged.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import datetime, timezone

REQUEST_LOGGER = "spectandem.requests"


class JsonFormatter(logging.Formatter):
    """{"time", "level", "logger", "message", ...the record's `fields`}, one line per record."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        out.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class RequestLog:
    """A router listener writing one record per request event to `logger`."""

    def __init__(self, logger: logging.Logger | None = None):
        self.log = logger or logging.getLogger(REQUEST_LOGGER)

    def __call__(self, event: str, req, data) -> None:
        now = time.monotonic()
        since = round(now - req.started, 6)
        fields: dict = {"event": event, "request_id": req.request_id}
        if event == "admitted":
            p = req.params
            fields.update(prompt_tokens=len(req.prompt_ids), max_tokens=p.max_tokens, temperature=p.temperature,
                          queue_s=since)
        elif event == "tokens":
            if not data.get("first"):
                return
            fields.update(event="first_token", ttft_s=since)
        elif event == "finished":
            fields.update(finish_reason=data, completion_tokens=len(req.tokens), e2e_s=since, **req.stats())
        elif event == "failed":
            fields.update(code=data, completion_tokens=len(req.tokens), e2e_s=since)
        elif event == "cancelled":
            fields.update(completion_tokens=len(req.tokens), e2e_s=since)
        self.log.info("request %s %s", fields["event"], req.request_id, extra={"fields": fields})


def configure_json_logging(level: str | int = "WARNING") -> None:
    """Entry-point logging setup for --log-format json: every record as a JSON line on stderr;
    request events at INFO whatever `level` the rest logs at."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=level, handlers=[handler], force=True)
    logging.getLogger(REQUEST_LOGGER).setLevel(logging.INFO)
