"""Request validation as pure functions: a request message and the model's limits in, checked values out.

Every API that serves generation (ringserve.v1 Generate, TorchServe's predictions, the Disaggregation service) runs
the same rules; none of them needs a servicer or a gRPC context, so an HTTP API can map `RequestError.code` to its
own status. A prompt's length in tokens is known only once it is tokenized, which is async (long prompts go to a
thread), so the checks come in two steps around the tokenizer: `prompt_input` before it (which also refuses a text
too long for the context length whatever it says, without tokenizing it: `check_prompt_size`), `check_prompt` and
`generation_options` after.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from ringserve import _core
from ringserve.frontend.engine_client import SamplingOptions
from ringserve.v1 import generation_pb2 as pb

# The public face of every sampling field (name, range, default when absent), declared with the field in records.h.
SAMPLING_API: tuple[dict[str, Any], ...] = _core.SAMPLING_API
DEFAULT_MAX_TOKENS: int = _core.AddRequest().max_tokens
MAX_LOGPROBS = int(next(f["max"] for f in SAMPLING_API if f["field"] == "num_logprobs"))  # top alternatives per token
MAX_N = 16  # completions one Generate request may ask for
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256  # also bounds the text held back while a stop string may be starting
MAX_CACHE_SALT_CHARS = 1024
_U64 = 1 << 64

GENERATE_INPUTS = ("text", "messages", "token_ids")
TOKENIZE_INPUTS = ("text", "messages")


class RequestError(Exception):
    """A request refused before it reaches the engine: the status to answer and the field at fault ("" = none)."""

    def __init__(self, code: grpc.StatusCode, field: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.field = field
        self.message = message


def _invalid(field: str, message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, field, message)


@dataclass(frozen=True)
class ModelLimits:
    """What validation needs to know about the served model; 0 means unknown (that check is skipped)."""

    model: str
    context_length: int = 0
    kv_capacity_tokens: int = 0
    vocab_size: int = 0
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    # The longest text (UTF-8 bytes) that can tokenize to fewer than context_length tokens: longer text is refused
    # before it is tokenized (see `prompt_bytes_bound`).
    max_prompt_bytes: int = 0

    @classmethod
    def of(cls, info: pb.ModelInfo, vocab_size: int, default_max_tokens: int = DEFAULT_MAX_TOKENS,
           max_bytes_per_token: int = 0) -> ModelLimits:
        """The limits in a ModelInfo; `vocab_size` stands in where the ModelInfo has none; `max_bytes_per_token`
        is the tokenizer's (ModelTokenizer.max_bytes_per_token), 0 = no size bound before tokenizing."""
        return cls(model=info.model, context_length=info.context_length, kv_capacity_tokens=info.kv_capacity_tokens,
                   vocab_size=info.vocab_size or vocab_size, default_max_tokens=default_max_tokens,
                   max_prompt_bytes=prompt_bytes_bound(info.context_length, max_bytes_per_token))


def prompt_bytes_bound(context_length: int, max_bytes_per_token: int) -> int:
    """The size bound checked before tokenizing: a text of more than (context_length - 1) x max_bytes_per_token
    bytes has at least context_length tokens, since no token stands for more than max_bytes_per_token bytes, so it
    would be refused after tokenizing anyway (check_prompt). 0 when either is unknown."""
    if context_length <= 1 or max_bytes_per_token <= 0:
        return 0
    return (context_length - 1) * max_bytes_per_token


@dataclass(frozen=True)
class PromptInput:
    """The one input a request sets, checked as far as it can be before tokenizing."""

    kind: str  # "text", "messages" or "token_ids"
    text: str = ""
    conversation: tuple[dict[str, str], ...] = ()
    add_generation_prompt: bool = True
    token_ids: tuple[int, ...] = ()
    add_special_tokens: bool = True


@dataclass(frozen=True)
class GenerationOptions:
    """A Generate request's checked options: the engine's sampling of sample 0, the sample count and stop strings."""

    params: SamplingOptions
    n: int
    stop: tuple[str, ...]
    include_stop_str_in_output: bool
    skip_special_tokens: bool


def check_model(name: str, limits: ModelLimits) -> None:
    """An empty `model` means the served one; any other name must be it (NOT_FOUND)."""
    if name and name != limits.model:
        raise RequestError(grpc.StatusCode.NOT_FOUND, "model",
                           f"model {name!r} is not served here; served: {limits.model!r} (or leave empty)")


def which_input(request: Any, fields: Sequence[str]) -> str:
    """The one input field the request sets; zero or several is INVALID_ARGUMENT naming them."""
    present = [name for name in fields if request.HasField(name)]
    allowed = ", ".join(f"`{name}`" for name in fields)
    if not present:
        raise _invalid("input", f"input is required: set exactly one of {allowed}")
    if len(present) > 1:
        raise _invalid("input", f"input: set exactly one of {allowed}, not {' and '.join(present)}")
    return present[0]


def prompt_input(request: Any, limits: ModelLimits, fields: Sequence[str] = GENERATE_INPUTS) -> PromptInput:
    """The request's input (`text`, `messages` or `token_ids`, of `fields`), checked up to tokenization."""
    kind = which_input(request, fields)
    add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
    if kind == "token_ids":
        ids = tuple(request.token_ids.ids)
        if not ids:
            raise _invalid("token_ids.ids", "token_ids.ids must not be empty")
        check_token_ids(ids, "token_ids.ids", limits)
        return PromptInput(kind, token_ids=ids, add_special_tokens=add_special)
    if kind == "text":
        if not request.text:
            raise _invalid("text", "text must not be empty")
        check_prompt_size(request.text, "text", limits)
        return PromptInput(kind, text=request.text, add_special_tokens=add_special)
    chat = request.messages
    if not chat.messages:
        raise _invalid("messages.messages", "messages.messages must not be empty")
    for index, message in enumerate(chat.messages):
        if not message.role:
            raise _invalid(f"messages.messages[{index}].role", f"messages.messages[{index}].role must not be empty")
    check_prompt_size([m.content for m in chat.messages], "messages", limits)
    conversation = tuple({"role": m.role, "content": m.content} for m in chat.messages)
    add_generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    return PromptInput(kind, conversation=conversation, add_generation_prompt=add_generation_prompt,
                       add_special_tokens=add_special)


def utf8_size(text: str, limit: int) -> int:
    """len(text.encode()), or just len(text) when that alone is over `limit` (a character takes at least a byte):
    a huge text is measured without a copy."""
    if len(text) > limit:
        return len(text)
    return len(text.encode("utf-8"))


def check_prompt_size(texts: str | Sequence[str], field: str, limits: ModelLimits) -> None:
    """Refuse, before tokenizing, a prompt (a text, or a conversation's message contents together) too long to fit
    the context length whatever it says: INVALID_ARGUMENT naming `field`. Costs O(1) for most texts, at most
    one UTF-8 encoding of the text."""
    limit = limits.max_prompt_bytes
    if not limit:
        return
    size = 0
    for text in [texts] if isinstance(texts, str) else texts:
        size += utf8_size(text, limit - size)
        if size > limit:
            shown = "the conversation's message contents have" if field == "messages" else f"{field} has"
            raise _invalid(field, f"{field}: the prompt is too long: {shown} more than {limit} bytes, which is more "
                                  f"than the context length of {limits.context_length} tokens can hold (no token "
                                  f"stands for more than {limit // (limits.context_length - 1)} bytes); shorten it")


def check_token_ids(ids: Sequence[int], field: str, limits: ModelLimits) -> None:
    """Every id must be in the vocabulary (INVALID_ARGUMENT naming the first one that is not)."""
    vocab_size = limits.vocab_size
    if not ids or not vocab_size or max(ids) < vocab_size:
        return
    for index, token_id in enumerate(ids):
        if token_id >= vocab_size:
            raise _invalid(f"{field}[{index}]", f"{field}[{index}] = {token_id} is out of range: the vocabulary has "
                                                f"{vocab_size} tokens (ids 0..{vocab_size - 1})")


def check_prompt(ids: Sequence[int], kind: str, limits: ModelLimits) -> None:
    """A tokenized prompt must be non-empty, leave room for one generated token and fit the KV cache."""
    if not ids:
        raise _invalid(kind, f"{kind} tokenized to no tokens")
    context_length = limits.context_length
    if context_length and len(ids) >= context_length:
        raise _invalid("prompt", f"the prompt has {len(ids)} tokens but the context length is {context_length}; "
                                 f"shorten the prompt to at most {context_length - 1} tokens so one can be generated")
    kv_capacity = limits.kv_capacity_tokens
    if kv_capacity and len(ids) + 1 > kv_capacity:
        raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, "prompt",
                           f"the prompt has {len(ids)} tokens but the KV cache holds at most {kv_capacity} tokens")


def generation_options(request: pb.GenerateRequest, prompt_len: int, limits: ModelLimits) -> GenerationOptions:
    """Everything of a Generate request but its input, once the prompt's length is known."""
    sampling = request.sampling
    params = sampling_options(sampling, prompt_len, limits, request.priority, request.cache_salt)
    n = num_samples(sampling)
    stop = stop_strings(sampling)
    skip_special = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
    return GenerationOptions(params, n, stop, sampling.include_stop_str_in_output, skip_special)


def sampling_options(sampling: pb.SamplingParams, prompt_len: int, limits: ModelLimits, priority: int = 0,
                     cache_salt: str = "") -> SamplingOptions:
    """The engine's sampling for a prompt of `prompt_len` tokens; max_tokens is cut to the room left in context."""
    if sampling.HasField("max_tokens"):
        max_tokens = sampling.max_tokens
        if max_tokens <= 0:
            raise _invalid("sampling.max_tokens", f"sampling.max_tokens must be > 0, got {max_tokens}")
    else:
        max_tokens = limits.default_max_tokens
    if limits.context_length:
        max_tokens = min(max_tokens, limits.context_length - prompt_len)  # never past the context length
    check_token_ids(sampling.stop_token_ids, "sampling.stop_token_ids", limits)
    engine_sampling = sampling_params(sampling)
    if engine_sampling.min_tokens > max_tokens:
        raise _invalid("sampling.min_tokens", f"sampling.min_tokens must be in [0, max_tokens = {max_tokens}], "
                                              f"got {engine_sampling.min_tokens}")
    if len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise _invalid("cache_salt",
                       f"cache_salt has {len(cache_salt)} characters; at most {MAX_CACHE_SALT_CHARS} are allowed")
    return SamplingOptions(max_tokens=max_tokens, sampling=engine_sampling, ignore_eos=sampling.ignore_eos,
                           stop_token_ids=tuple(sampling.stop_token_ids), priority=priority,
                           cache_salt=cache_salt_hash(cache_salt))  # fmt: skip


def sampling_params(sampling: pb.SamplingParams) -> _core.SamplingParams:
    """The engine's SamplingParams from the API's: every field the records declare (SAMPLING_API), absent ones at
    the record's default, each checked against its declared range (floats also finite); a field the API marks by
    presence (has_seed) is true when that field is set."""
    values: dict[str, Any] = {}
    for spec in SAMPLING_API:
        if spec["presence_of"]:
            values[spec["field"]] = sampling.HasField(spec["presence_of"])
            continue
        name, low, high = spec["api"], spec["min"], spec["max"]
        value = getattr(sampling, name) if sampling.HasField(name) else spec["default"]
        finite = not isinstance(value, float) or math.isfinite(value)
        in_range = (low < value if spec["min_open"] else low <= value) and value <= high
        if not (finite and in_range):
            raise _invalid(f"sampling.{name}", f"sampling.{name} must be {_range_text(spec)}, got {value}")
        values[spec["field"]] = value
    return _core.SamplingParams(**values)


def _range_text(spec: dict[str, Any]) -> str:
    """ "in (0, 1]", ">= 0 (0 = greedy)": what the declared range of a sampling field accepts."""
    low, high = spec["min"], spec["max"]
    if math.isinf(high):
        text = f"{'>' if spec['min_open'] else '>='} {low:g}"
    else:
        text = f"in {'(' if spec['min_open'] else '['}{low:g}, {high:g}]"
    return f"{text} ({spec['note']})" if spec["note"] else text


def num_samples(sampling: pb.SamplingParams) -> int:
    n = sampling.n if sampling.HasField("n") else 1
    if not 1 <= n <= MAX_N:
        raise _invalid("sampling.n", f"sampling.n must be in [1, {MAX_N}], got {n}")
    return n


def require_one_sample(n: int, why: str) -> None:
    """Requests that carry one engine request's KV (a prefill, a decode from KV) cannot fan out."""
    if n != 1:
        raise _invalid("sampling.n", f"sampling.n must be 1 for {why}")


def stop_strings(sampling: pb.SamplingParams) -> tuple[str, ...]:
    stop = tuple(sampling.stop)
    if len(stop) > MAX_STOP_STRINGS:
        raise _invalid("sampling.stop",
                       f"sampling.stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
    for index, text in enumerate(stop):
        if not text:
            raise _invalid(f"sampling.stop[{index}]", f"sampling.stop[{index}] must not be empty")
        if len(text) > MAX_STOP_STRING_CHARS:
            raise _invalid(f"sampling.stop[{index}]", f"sampling.stop[{index}] has {len(text)} characters; at most "
                                                      f"{MAX_STOP_STRING_CHARS} are allowed")
    return stop


def sample_params(params: SamplingOptions, index: int) -> SamplingOptions:
    """Sample `index` of n: with a seed, seed + index (documented in SamplingParams.n)."""
    if index == 0 or params.seed is None:
        return params
    sampling = copy.copy(params.sampling)
    sampling.seed = (params.seed + index) % _U64
    return dataclasses.replace(params, sampling=sampling)


def cache_salt_hash(salt: str) -> int:
    """The engine's u64 prefix-cache salt for a request's `cache_salt`: 0 (none) when empty, else nonzero."""
    if not salt:
        return 0
    digest = hashlib.blake2b(salt.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1
MAX_JSON_DEPTH = 32  # nesting a request body may have (TorchServe's JSON; a real one has 3 or 4 levels)


def json_body(text: str, field: str) -> Any:
    """`text` parsed as JSON, or None when it is not JSON (a TorchServe body may be the prompt as plain text).

    Refuses, naming `field`, what the parser cannot take safely: nesting deeper than MAX_JSON_DEPTH (which would
    otherwise exhaust the parser's recursion) and integers too long to convert."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise _invalid(field, f"{field}: JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    except json.JSONDecodeError:
        return None
    except ValueError as exc:  # e.g. an integer of more digits than int() converts
        raise _invalid(field, f"{field}: JSON value not accepted: {exc}") from None
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise _invalid(field, f"{field}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
            pending.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return value


# GenerateRequest fields besides `sampling` that a JSON object of sampling fields may also set (KServe's
# sampling_parameters, as vLLM's SamplingParams does).
JSON_REQUEST_FIELDS = ("skip_special_tokens", "priority", "cache_salt")
_JSON_TRUE, _JSON_FALSE = ("true", "1"), ("false", "0")


def json_generate_fields(body: Any, field: str, out: pb.GenerateRequest) -> None:
    """Set `out.sampling`'s fields (and JSON_REQUEST_FIELDS) from a JSON object of them, named as in
    ringserve.v1's SamplingParams; the proto declares each one's type. Numbers and booleans may come as strings
    ("0.7", "true"), as Triton's vLLM backend takes them. An unknown key, a value of the wrong type or outside the
    proto field's range is INVALID_ARGUMENT naming `field.key`; the sampling ranges are checked later, as for
    every API (`sampling_params`)."""
    if not isinstance(body, dict):
        raise _invalid(field, f"{field}: expected a JSON object of sampling fields, got {_quoted(body)}")
    sampling_fields = pb.SamplingParams.DESCRIPTOR.fields_by_name
    for key, value in body.items():
        where = f"{field}.{key}"
        if key in sampling_fields:
            target, descriptor = out.sampling, sampling_fields[key]
        elif key in JSON_REQUEST_FIELDS:
            target, descriptor = out, pb.GenerateRequest.DESCRIPTOR.fields_by_name[key]
        else:
            known = ", ".join([*sampling_fields, *JSON_REQUEST_FIELDS])
            raise _invalid(where, f"{where}: not a sampling field RingServe knows; known: {known}")
        if descriptor.is_repeated:
            items = [value] if isinstance(value, str) else value
            if not isinstance(items, list):
                raise _invalid(where, f"{where}: expected a list, got {_quoted(value)}")
            converted = [_json_scalar(item, descriptor, where) for item in items]
            try:
                getattr(target, key).extend(converted)
            except (ValueError, TypeError) as exc:
                raise _invalid(where, f"{where}: out of range ({exc})") from None
            continue
        try:
            setattr(target, key, _json_scalar(value, descriptor, where))
        except (ValueError, TypeError) as exc:  # e.g. a negative or huge seed for a uint64
            raise _invalid(where, f"{where}: {_quoted(value)} is out of range ({exc})") from None


def _json_scalar(value: Any, descriptor: Any, where: str) -> bool | int | float | str:
    """A JSON value as the proto field's scalar type, without lossy conversions (2.5 is no integer)."""
    kind = descriptor.cpp_type
    if kind == descriptor.CPPTYPE_STRING:
        if isinstance(value, str):
            return value
    elif kind == descriptor.CPPTYPE_BOOL:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _JSON_TRUE + _JSON_FALSE:
            return value.lower() in _JSON_TRUE
    elif not isinstance(value, bool):
        number: Any = value
        if isinstance(value, str):
            try:
                number = float(value) if kind in (descriptor.CPPTYPE_FLOAT, descriptor.CPPTYPE_DOUBLE) else int(value)
            except ValueError:
                number = None
        if kind in (descriptor.CPPTYPE_FLOAT, descriptor.CPPTYPE_DOUBLE):
            if isinstance(number, int | float):
                try:
                    real = float(number)
                except OverflowError:  # an integer beyond any float
                    real = math.inf
                if math.isfinite(real):
                    return real
        elif isinstance(number, int) or (isinstance(number, float) and number.is_integer()):
            return int(number)
    wanted = {descriptor.CPPTYPE_STRING: "a string", descriptor.CPPTYPE_BOOL: "a boolean",
              descriptor.CPPTYPE_FLOAT: "a finite number", descriptor.CPPTYPE_DOUBLE: "a finite number"}
    raise _invalid(where, f"{where}: expected {wanted.get(kind, 'an integer')}, got {_quoted(value)}")


def _quoted(value: Any) -> str:
    """A value as an error message quotes it: at most 60 characters."""
    if isinstance(value, int) and value.bit_length() > 200:
        return f"an integer of {len(str(abs(value)))} digits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
