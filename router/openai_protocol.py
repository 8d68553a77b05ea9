"""The OpenAI wire format of the HTTP front (router/openai_http.py): request bodies become the
same `GenerateRequest` the gRPC API validates, responses and errors take OpenAI's shapes.

Fields read (others are ignored, as OpenAI clients send many):
    both        model (404 unless the served model's name), max_tokens, temperature (default 1.0,
                as OpenAI), top_p, seed, stop (a string or a list), stream,
                stream_options.include_usage; extras as in vLLM: top_k (-1 or 0 = off),
                stop_token_ids, ignore_eos, return_token_ids (adds prompt_token_ids and token_ids
                to each choice)
    completions prompt (a string, token ids, or a one-element list of either); max_tokens
                defaults to 16 (OpenAI's default)
    chat        messages (rendered by the model's chat template), max_completion_tokens (or
                max_tokens); the default is the rest of the context
Features this server does not have (n > 1, best_of, echo, logprobs, suffix, penalties,
logit_bias, tools, response_format other than text) are refused with 400 rather than ignored.

Errors: {"error": {"message", "type", "param", "code"}}; `code` is the gRPC status name the same
request gets from the gRPC API (INVALID_ARGUMENT, UNAVAILABLE, ...), `param` the request field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from spectandem.v1 import common_pb2, generation_pb2

COMPLETIONS_DEFAULT_MAX_TOKENS = 16

HTTP_STATUS = {"INVALID_ARGUMENT": 400, "OUT_OF_RANGE": 400, "FAILED_PRECONDITION": 400, "UNAUTHENTICATED": 401,
               "PERMISSION_DENIED": 403, "NOT_FOUND": 404, "ALREADY_EXISTS": 409, "RESOURCE_EXHAUSTED": 429,
               "CANCELLED": 499, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 409: "conflict_error", 429: "rate_limit_error", 503: "service_unavailable_error"}


class ApiError(Exception):
    """An error answer: HTTP status, message, the request field at fault, and a string code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND"}.get(status, "INTERNAL")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, message, param)


# `validate` (router/server.py) names the field first: "params.max_tokens must be ...",
# "prompt.token_ids[3] = ...", "seed must be ..."; the OpenAI field is that name without "params.".
_FIELD = re.compile(r"^(?:params\.)?([a-z_]+)")


def error_from_status(code_name: str, message: str, prompt_param: str = "prompt") -> ApiError:
    """The HTTP answer for what the gRPC API answers with status `code_name` and `message`."""
    status = HTTP_STATUS.get(code_name, 500)
    param = None
    if status == 400:
        message = message.removeprefix("params.")
        m = _FIELD.match(message)
        param = m.group(1) if m else None
        if param == "prompt":
            param = prompt_param
    return ApiError(status, message, param, code_name)


# ------------------------------------------------------------------------------ request bodies

@dataclass(frozen=True)
class Parsed:
    request: generation_pb2.GenerateRequest
    stream: bool
    include_usage: bool
    return_token_ids: bool
    prompt_param: str          # the field a prompt error names: "prompt" or "messages"


def _typed(body: dict, name: str, types: tuple, what: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        raise invalid(name, f"{name} must be {what}, got {json.dumps(value)[:80]}")
    return value


def _refuse_unsupported(body: dict, chat: bool) -> None:
    checks = [("n", lambda v: v != 1), ("best_of", lambda v: v != 1), ("echo", bool), ("suffix", lambda v: True),
              ("presence_penalty", lambda v: v != 0), ("frequency_penalty", lambda v: v != 0),
              ("logit_bias", bool), ("tools", bool), ("top_logprobs", bool),
              ("logprobs", bool if chat else (lambda v: True)),
              ("response_format", lambda v: not isinstance(v, dict) or v.get("type", "text") != "text")]
    for name, unsupported in checks:
        if body.get(name) is not None and unsupported(body[name]):
            raise invalid(name, f"{name}={json.dumps(body[name])[:80]} is not supported by this server")


def check_model(body: dict, model_name: str) -> None:
    model = body.get("model")
    if model is not None and model != model_name:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves `{model_name}`", "model",
                       "NOT_FOUND")


def _sampling_params(body: dict, default_max_tokens: int | None) -> common_pb2.SamplingParams:
    max_tokens = _typed(body, "max_completion_tokens", (int,), "an integer")
    if max_tokens is None:
        max_tokens = _typed(body, "max_tokens", (int,), "an integer", default_max_tokens)
    temperature = _typed(body, "temperature", (int, float), "a number", 1.0)
    top_p = _typed(body, "top_p", (int, float), "a number", 1.0)
    top_k = _typed(body, "top_k", (int,), "an integer", 0)
    seed = _typed(body, "seed", (int,), "an integer")
    if seed is not None and not 0 <= seed < 2 ** 64:
        raise invalid("seed", f"seed must be an integer in [0, 2**64), got {seed}")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise invalid("stop", "stop must be a string or a list of strings")
    stop_token_ids = _typed(body, "stop_token_ids", (list,), "a list of token ids", [])
    ignore_eos = _typed(body, "ignore_eos", (bool,), "a boolean", False)
    fields = dict(max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
                  top_k=0 if top_k == -1 else top_k, stop=stop, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
                  seed=seed)
    p = common_pb2.SamplingParams()
    for name, value in fields.items():
        if value is None:
            continue
        try:
            if isinstance(value, list):
                getattr(p, name).extend(value)
            else:
                setattr(p, name, value)
        except (TypeError, ValueError):  # outside the wire type's range: negative, > 2**32, ...
            raise invalid(name, f"{name} = {json.dumps(value)[:80]} is out of range") from None
    return p


def _flags(body: dict) -> dict:
    opts = _typed(body, "stream_options", (dict,), "an object", {})
    return dict(stream=_typed(body, "stream", (bool,), "a boolean", False),
                include_usage=bool(opts.get("include_usage")),
                return_token_ids=_typed(body, "return_token_ids", (bool,), "a boolean", False))


def _set_token_ids(request: generation_pb2.GenerateRequest, ids: list, param: str) -> None:
    """Sets the token-ids prompt (even when empty: `validate` then names the empty prompt)."""
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise invalid(param, f"{param} token ids must be integers")
    try:
        request.token_ids.ids.extend(ids)
    except ValueError:
        raise invalid(param, f"{param} has a token id outside [0, 2**32)") from None
    request.token_ids.SetInParent()


def completion_request(body: dict, request_id: str) -> Parsed:
    _refuse_unsupported(body, chat=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    request = generation_pb2.GenerateRequest(request_id=request_id,
                                             params=_sampling_params(body, COMPLETIONS_DEFAULT_MAX_TOKENS))
    if isinstance(prompt, str):
        request.text = prompt
    elif not isinstance(prompt, list):
        raise invalid("prompt", "prompt must be a string or a list of token ids")
    elif any(isinstance(p, (str, list)) for p in prompt):
        raise invalid("prompt", f"prompt has {len(prompt)} prompts; this server takes one per request")
    else:
        _set_token_ids(request, prompt, "prompt")
    return Parsed(request, prompt_param="prompt", **_flags(body))


def chat_request(body: dict, request_id: str, template: ChatTemplate, tokenizer, max_context: int,
                 max_prompt_chars: int = 0) -> Parsed:
    """Renders and tokenises the messages: run it in a worker thread (it takes time on long
    messages). A rendered prompt over `max_prompt_chars` (0 = no cap) is refused before it is
    tokenised."""
    from router.server import encode_text

    _refuse_unsupported(body, chat=True)
    text = template.render(_messages(body.get("messages")))
    if max_prompt_chars and len(text) > max_prompt_chars:
        raise invalid("messages", f"messages render to a prompt of {len(text)} characters; the limit is "
                                  f"{max_prompt_chars} (more cannot fit the context of {max_context} tokens)")
    ids = encode_text(tokenizer, text, add_special_tokens=False)  # the template wrote the special tokens
    params = _sampling_params(body, default_max_tokens=max(1, max_context - len(ids)))
    request = generation_pb2.GenerateRequest(request_id=request_id, params=params)
    _set_token_ids(request, ids, "messages")
    return Parsed(request, prompt_param="messages", **_flags(body))


# ------------------------------------------------------------------------------ JSON bodies

MAX_JSON_DEPTH = 64   # objects and arrays nested deeper than this are refused (400)


def parse_json_body(raw: str) -> dict:
    """The request body as a dict, or a 400 ApiError naming the problem: not JSON, not an object,
    nested more than MAX_JSON_DEPTH levels, or a string holding a lone UTF-16 surrogate ("\\ud800"
    decodes to one; it is not a character and cannot be UTF-8 encoded), naming where it is."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(400, f"the request body nests JSON objects/arrays more than {MAX_JSON_DEPTH} levels "
                            "deep") from None
    except ValueError as exc:  # json.JSONDecodeError
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    stack: list[tuple[object, str, int]] = [(body, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _check_utf8(value, path)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"the request body nests JSON objects/arrays more than {MAX_JSON_DEPTH} levels "
                                f"deep (at {path})", path.split(".")[0].split("[")[0] or None)
        if isinstance(value, dict):
            for key, item in value.items():
                where = f"{path}.{key}" if path else key
                _check_utf8(key, where)
                stack.append((item, where, depth + 1))
        else:
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))
    return body


def _check_utf8(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"{path} holds a lone surrogate ({ascii(text[exc.start])}) at character {exc.start}: "
                            "it is not a Unicode character; send valid UTF-8 text",
                       path.split(".")[0].split("[")[0]) from None


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise invalid("messages", f"messages[{i}] must be an object with a string role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise invalid("messages", f"messages[{i}].content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        elif content is not None and not isinstance(content, str):
            raise invalid("messages", f"messages[{i}].content must be a string or a list of text parts")
        out.append({**m, "content": content or ""})
    return out


# ------------------------------------------------------------------------------ chat templates

class ChatTemplate:
    """A HuggingFace chat template (Jinja), rendered as transformers does: a sandboxed
    environment, trim_blocks and lstrip_blocks, `raise_exception`, `bos_token`/`eos_token`, and
    add_generation_prompt=True."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise invalid("messages", f"the chat template refused the messages: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = raise_exception
        self.template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: list[dict]) -> str:
        from jinja2 import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=True, bos_token=self.bos_token,
                                        eos_token=self.eos_token, tools=None)
        except TemplateError as exc:
            raise invalid("messages", f"the chat template failed on these messages: {exc}") from None

    @classmethod
    def from_model_dir(cls, directory: str | Path) -> ChatTemplate | None:
        """The template of a HuggingFace model directory (chat_template.jinja, or `chat_template`
        in tokenizer_config.json: a string, or a list of {name, template} with a "default"), or
        None when it has none."""
        d = Path(directory)
        config = {}
        if (d / "tokenizer_config.json").is_file():
            config = json.loads((d / "tokenizer_config.json").read_text())
        source = (d / "chat_template.jinja").read_text() if (d / "chat_template.jinja").is_file() else \
            config.get("chat_template")
        if isinstance(source, list):
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if not source:
            return None

        def token(name):
            t = config.get(name) or ""
            return t.get("content", "") if isinstance(t, dict) else t

        return cls(source, token("bos_token"), token("eos_token"))


# ------------------------------------------------------------------------------ responses

def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice(chat: bool, stream: bool, text: str, finish_reason: str | None, token_ids: list[int] | None = None,
           prompt_token_ids: list[int] | None = None, first: bool = False) -> dict:
    if not chat:
        out = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    elif stream:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        out = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        out = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
               "finish_reason": finish_reason}
    if token_ids is not None:
        out["token_ids"] = token_ids
    if prompt_token_ids is not None:
        out["prompt_token_ids"] = prompt_token_ids
    return out


def envelope(chat: bool, stream: bool, response_id: str, created: int, model: str, choices: list,
             usage_: dict | None = None) -> dict:
    kind = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
    out = {"id": response_id, "object": kind, "created": created, "model": model, "choices": choices}
    if usage_ is not None or not stream:
        out["usage"] = usage_
    return out
