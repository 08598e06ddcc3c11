"""OpenAI request bodies into `ringserve.v1` GenerateRequests, and refusals into OpenAI's error bodies.

A chat completion is one GenerateRequest with `messages`; a text completion is one per prompt (a string, token ids,
or a list of either). Every field is copied by name from one table (`_FIELDS`), which also names the OpenAI field in
the errors the shared validation (api/validation.py) raises with the `ringserve.v1` field's path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import grpc
import pydantic
from ringserve.frontend.api.openai_models import (
    UNSUPPORTED_FIELDS,
    UNSUPPORTED_MESSAGE_FIELDS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
)
from ringserve.frontend.api.validation import MAX_STOP_STRINGS, RequestError, json_body
from ringserve.v1 import generation_pb2 as pb

MAX_PROMPTS = 64  # prompts one text completion request may carry (each is one GenerateRequest)

# OpenAI field -> (GenerateRequest part, its field): copied when the body sets it (not null).
_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("max_tokens", "sampling", "max_tokens"), ("temperature", "sampling", "temperature"),
    ("top_p", "sampling", "top_p"), ("n", "sampling", "n"), ("seed", "sampling", "seed"),
    ("presence_penalty", "sampling", "presence_penalty"), ("frequency_penalty", "sampling", "frequency_penalty"),
    ("top_k", "sampling", "top_k"), ("min_p", "sampling", "min_p"),
    ("repetition_penalty", "sampling", "repetition_penalty"), ("min_tokens", "sampling", "min_tokens"),
    ("ignore_eos", "sampling", "ignore_eos"), ("include_stop_str_in_output", "sampling", "include_stop_str_in_output"),
    ("skip_special_tokens", "request", "skip_special_tokens"), ("priority", "request", "priority"),
    ("cache_salt", "request", "cache_salt"), ("add_special_tokens", "request", "add_special_tokens"),
)  # fmt: skip
# ringserve.v1 field paths (as validation names them) -> the OpenAI field; longest first for prefix matching.
_PARAM_OF_PATH: dict[str, str] = {
    **{("sampling." if part == "sampling" else "") + field: name for name, part, field in _FIELDS},
    "sampling.stop": "stop", "sampling.stop_token_ids": "stop_token_ids", "sampling.logprobs": "logprobs",
    "messages.messages": "messages", "token_ids.ids": "prompt", "text": "prompt", "token_ids": "prompt",
}  # fmt: skip

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499, grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}  # fmt: skip
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 409: "invalid_request_error", 413: "invalid_request_error",
                429: "rate_limit_error", 499: "cancelled", 503: "service_unavailable_error", 504: "timeout_error"}


class ApiError(Exception):
    """A refusal with its HTTP status, answered as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        kind = _ERROR_TYPES.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    @classmethod
    def from_status(cls, code: grpc.StatusCode, message: str, field: str = "",
                    renames: Mapping[str, str] | None = None) -> ApiError:  # fmt: skip
        """A gRPC status and the field at fault (a ringserve.v1 path, named as `renames` or `_PARAM_OF_PATH` say)
        in HTTP and OpenAI terms."""
        status = _HTTP_STATUS.get(code, 500)
        param = openai_param(field, renames) if field else None
        if param is not None:
            message = message.replace(field, param, 1)
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and field:
            status = 400  # the request itself is too large (its prompt for the KV cache), not the server busy
        error_code = "model_not_found" if code == grpc.StatusCode.NOT_FOUND else (
            "invalid_value" if status == 400 else code.name.lower())  # fmt: skip
        return cls(status, message, param, error_code)

    @classmethod
    def from_rejection(cls, rejection: RequestError, renames: Mapping[str, str] | None = None) -> ApiError:
        return cls.from_status(rejection.code, rejection.message, rejection.field, renames)


# Where an endpoint names a ringserve.v1 field differently from the table.
CHAT_RENAMES = {"sampling.logprobs": "top_logprobs"}
DETOKENIZE_RENAMES = {"token_ids": "tokens"}


def openai_param(path: str, renames: Mapping[str, str] | None = None) -> str:
    """The OpenAI field a ringserve.v1 field path stands for: `sampling.top_p` -> `top_p`, `messages.messages[2].role`
    -> `messages[2].role`, `token_ids.ids[5]` -> `prompt[5]`."""
    names = {**_PARAM_OF_PATH, **(renames or {})}
    for prefix in sorted(names, key=len, reverse=True):
        if path == prefix or path.startswith(prefix + "[") or path.startswith(prefix + "."):
            return names[prefix] + path[len(prefix):]
    return path


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, message, param, "invalid_value")


# -- bodies -----------------------------------------------------------------------------------------------------------


def parse_body(raw: bytes, model: type[pydantic.BaseModel]) -> Any:
    """The body as `model`: 400 for text that is not a JSON object, for unsupported and unknown fields and for
    values of the wrong type, each naming the field."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid("", f"the request body is not UTF-8 text: {exc}") from None
    try:
        value = json_body(text, "body")
    except RequestError as rejection:
        raise ApiError.from_rejection(rejection) from None
    if not isinstance(value, dict):
        what = "empty" if not text.strip() else "not JSON" if value is None and text.strip() != "null" else \
            f"a JSON {type(value).__name__}"
        raise invalid("", f"the request body must be a JSON object; it is {what}")
    _refuse_unsupported(value, UNSUPPORTED_FIELDS, "")
    messages = value.get("messages")
    for index, message in enumerate(messages if isinstance(messages, list) else ()):
        if isinstance(message, dict):
            _refuse_unsupported(message, UNSUPPORTED_MESSAGE_FIELDS, f"messages[{index}].")
            _refuse_non_text_parts(message.get("content"), f"messages[{index}].content")
    try:
        return model.model_validate(value)
    except pydantic.ValidationError as exc:
        raise _validation_error(exc) from None


def _refuse_unsupported(body: dict[str, Any], unsupported: Mapping[str, str], where: str) -> None:
    """Unsupported fields set to null are dropped (some clients send every field); any other value is a 400."""
    for name in [key for key in body if key in unsupported]:
        value = body[name]
        if value is None or (name == "response_format" and value == {"type": "text"}) or (
                name == "best_of" and value == body.get("n", 1)):  # fmt: skip
            del body[name]
            continue
        raise ApiError(400, f"{where}{name} is not supported by this server ({unsupported[name]} is not "
                            "implemented); remove the field", f"{where}{name}", "unsupported_field")  # fmt: skip


def _refuse_non_text_parts(content: Any, where: str) -> None:
    for index, part in enumerate(content if isinstance(content, list) else ()):
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind != "text":
            raise ApiError(400, f"{where}[{index}].type: content parts of type {kind!r} are not supported by this "
                                "server (only text)", f"{where}[{index}].type", "unsupported_field")  # fmt: skip


def _validation_error(exc: pydantic.ValidationError) -> ApiError:
    error = exc.errors(include_url=False)[0]
    # A union's errors name the member tried (`str`, `list[TextPart]`) in the location: not a field.
    loc = [part for part in error["loc"] if isinstance(part, int) or not _is_type_tag(part)]
    param = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
    if error["type"] == "extra_forbidden":
        return ApiError(400, f"unknown field {param!r}; see docs/apis.md for the fields this server accepts", param,
                        "unknown_field")  # fmt: skip
    if error["type"] == "missing":
        return invalid(param, f"{param} is required")
    shown = repr(error.get("input"))
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return invalid(param, f"{param}: {error['msg']} (got {shown})")


def _is_type_tag(part: str) -> bool:
    return "[" in part or part in ("str", "int", "float", "bool", "none", "function-after", "literal")


# -- into GenerateRequests ------------------------------------------------------------------------------------------


def chat_request(body: ChatCompletionRequest, request_id: str) -> pb.GenerateRequest:
    if not body.messages:
        raise invalid("messages", "messages must not be empty")
    request = pb.GenerateRequest(model=body.model or "", request_id=request_id)
    for index, message in enumerate(body.messages):
        request.messages.messages.add(role=message.role, content=_message_text(message, index))
    if body.add_generation_prompt is not None:
        request.messages.add_generation_prompt = body.add_generation_prompt
    _copy_fields(body, request)
    if body.max_completion_tokens is not None:  # OpenAI's newer name wins over max_tokens
        _set(request.sampling, "max_tokens", body.max_completion_tokens, "max_completion_tokens")
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs", "top_logprobs needs logprobs: true")
    if body.logprobs:
        _set(request.sampling, "logprobs", body.top_logprobs or 0, "top_logprobs")
    return request


def _message_text(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None:
        raise invalid(f"messages[{index}].content", f"messages[{index}].content is required")
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def completion_requests(body: CompletionRequest, request_id: str) -> list[pb.GenerateRequest]:
    """One GenerateRequest per prompt of the body (ids `<request_id>-<i>` when there are several)."""
    prompts = _prompts(body.prompt)
    if body.echo and body.logprobs is not None:
        raise ApiError(400, "echo with logprobs is not supported by this server (it would need the prompt's "
                            "log-probabilities); drop one of them", "echo", "unsupported_field")  # fmt: skip
    requests = []
    for index, prompt in enumerate(prompts):
        request = pb.GenerateRequest(model=body.model or "",
                                     request_id=request_id if len(prompts) == 1 else f"{request_id}-{index}")
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.ids.extend(prompt)
        _copy_fields(body, request)
        if body.logprobs is not None:
            _set(request.sampling, "logprobs", body.logprobs, "logprobs")
        requests.append(request)
    return requests


def _prompts(prompt: Any) -> list[str | list[int]]:
    """`prompt` as a list of prompts: a string, token ids, or a non-empty list of either."""
    def is_ids(value: Any) -> bool:
        return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                               and 0 <= t < 2**32 for t in value)  # fmt: skip

    if isinstance(prompt, str) or is_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise invalid("prompt", f"prompt has {len(prompt)} prompts; at most {MAX_PROMPTS} are allowed")
        return list(prompt)
    if prompt is None:
        raise invalid("prompt", "prompt is required")
    raise invalid("prompt", "prompt must be a string, a list of token ids (non-negative integers), or a non-empty "
                            "list of strings or of token id lists")  # fmt: skip


def _copy_fields(body: SamplingFields, request: pb.GenerateRequest) -> None:
    for name, part, field in _FIELDS:
        value = getattr(body, name)
        if value is not None:
            _set(request.sampling if part == "sampling" else request, field, value, name)
    stop = body.stop
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise invalid("stop", "stop must be a string or a list of strings")
        if len(stops) > MAX_STOP_STRINGS:
            raise invalid("stop", f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed")
        request.sampling.stop.extend(stops)
    if body.stop_token_ids:
        if not all(0 <= t < 2**32 for t in body.stop_token_ids):
            raise invalid("stop_token_ids", "stop_token_ids must be non-negative token ids")
        request.sampling.stop_token_ids.extend(body.stop_token_ids)
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options", "stream_options is only allowed with stream: true")


def _set(message: Any, field: str, value: Any, name: str) -> None:
    try:
        setattr(message, field, value)
    except (ValueError, TypeError, OverflowError):  # out of the ringserve.v1 field's range (int32, uint64, float)
        shown = f"an integer of {len(str(value))} digits" if isinstance(value, int) and value > 10**30 else value
        raise invalid(name, f"{name}: {shown} is out of range") from None

