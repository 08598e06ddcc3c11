"""Every sampling field reaches every layer it crosses, with the one set of defaults the records declare.

A SamplingParams field is declared once, in csrc/ringserve/records.h (name, type, default, and its face in the public
API: name, range, meaning of special values). Each layer derives from that declaration; this test walks every field
through each of them, so a field the proto, the frontend's validation or the workers' batch and sampler forget fails
here by name: the proto message has it (optional, so "absent" means the record's default), `SamplingOptions` carries
the record's defaults, validation takes the value, refuses values outside the declared range, and the workers' batch
keeps a per-slot column that the batch or the sampler reads.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from ringserve import _core
from ringserve.frontend.api import validation
from ringserve.frontend.api.validation import RequestError, sampling_params
from ringserve.frontend.engine_client import SamplingOptions
from ringserve.v1 import generation_pb2 as pb
from ringserve.workers import input_batch
from ringserve.workers.input_batch import InputBatch
from ringserve.workers.sampler import SamplingBatch

DEFAULTS = dict(_core.SAMPLING_FIELDS)
API = {spec["field"]: spec for spec in _core.SAMPLING_API}
SET_BY_CLIENT = [name for name in DEFAULTS if not API[name]["presence_of"]]
PROTO_FIELDS = pb.SamplingParams.DESCRIPTOR.fields_by_name


def other_value(name: str) -> Any:
    """A value of field `name` inside its declared range that is not its default."""
    spec, default = API[name], DEFAULTS[name]
    if isinstance(default, bool):
        return not default
    step = 1 if isinstance(default, int) else 0.5
    candidate = default + step
    if candidate <= spec["max"]:
        return candidate
    return type(default)((spec["min"] + spec["max"]) / 2)


def outside_values(name: str) -> list[Any]:
    """Values just outside the declared range of `name` (and NaN for a float field)."""
    spec, default = API[name], DEFAULTS[name]
    values: list[Any] = []
    if math.isfinite(spec["min"]):
        values.append(type(default)(spec["min"] if spec["min_open"] else spec["min"] - 1))
    if math.isfinite(spec["max"]):
        values.append(type(default)(spec["max"] + 1))
    if isinstance(default, float):
        values.append(math.nan)
    return values


def test_the_records_declare_each_field_once_with_its_api_face() -> None:
    assert list(API) == list(DEFAULTS)  # one declaration drives both views
    assert DEFAULTS["temperature"] == 1.0 and API["num_logprobs"]["api"] == "logprobs"


@pytest.mark.parametrize("name", list(DEFAULTS))
def test_the_proto_has_the_field_with_presence(name: str) -> None:
    spec = API[name]
    api_name = spec["presence_of"] or spec["api"]
    assert api_name in PROTO_FIELDS, f"protos/ringserve/v1 SamplingParams has no field {api_name!r} for {name}"
    assert PROTO_FIELDS[api_name].has_presence, f"SamplingParams.{api_name} must be optional (absent = default)"


def test_sampling_options_take_the_records_defaults() -> None:
    options = SamplingOptions(max_tokens=1)
    assert options.sampling == _core.SamplingParams()
    for name, default in DEFAULTS.items():
        assert getattr(options.sampling, name) == default, name
    assert options.seed is None
    assert validation.DEFAULT_MAX_TOKENS == _core.AddRequest().max_tokens


def test_an_absent_field_is_the_records_default() -> None:
    assert sampling_params(pb.SamplingParams()) == _core.SamplingParams()


@pytest.mark.parametrize("name", SET_BY_CLIENT)
def test_validation_takes_the_field(name: str) -> None:
    value = other_value(name)
    got = getattr(sampling_params(pb.SamplingParams(**{API[name]["api"]: value})), name)
    assert got == pytest.approx(value), name


@pytest.mark.parametrize("name", [n for n in SET_BY_CLIENT if outside_values(n)])
def test_validation_refuses_values_outside_the_declared_range(name: str) -> None:
    api_name = API[name]["api"]
    for value in outside_values(name):
        with pytest.raises(RequestError) as error:
            sampling_params(pb.SamplingParams(**{api_name: value}))
        assert error.value.field == f"sampling.{api_name}", value


def test_a_presence_field_follows_its_api_field() -> None:
    assert sampling_params(pb.SamplingParams(seed=0)).has_seed
    assert not sampling_params(pb.SamplingParams()).has_seed


class Reads(dict):
    """A mapping that records which keys were read."""

    seen: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        Reads.seen.add(key)
        return super().__getitem__(key)


def test_the_worker_batch_keeps_and_uses_every_field(monkeypatch: pytest.MonkeyPatch) -> None:
    from_columns = SamplingBatch.from_columns.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(SamplingBatch, "from_columns",
                        classmethod(lambda cls, params, *a, **k: from_columns(cls, Reads(params), *a, **k)))
    greedy_is_plain = input_batch.greedy_is_plain
    monkeypatch.setattr(input_batch, "greedy_is_plain", lambda params: greedy_is_plain(Reads(params)))
    batch = InputBatch(block_size=4, num_kv_blocks=8, max_position=64, device=torch.device("cpu"))
    columns = batch.params
    for name, default in DEFAULTS.items():
        assert name in columns and columns[name][0] == default, f"the workers' batch lacks {name} at its default"
    values = {name: other_value(name) for name in DEFAULTS}
    request = _core.NewRequestData(slot=0, token_ids=[1, 2, 3], num_prompt_tokens=3, block_ids=[0],
                                   sampling=_core.SamplingParams(**values))  # fmt: skip
    batch.params = Reads(columns)
    Reads.seen = set()  # from here on, only what the workers' code reads
    batch.add(request)
    batch.sampling_batch(np.array([0]))
    for name, value in values.items():
        assert columns[name][0] == pytest.approx(value), f"the workers' batch did not keep {name}"
    unused = set(DEFAULTS) - Reads.seen
    assert not unused, f"no worker layer (InputBatch, SamplingBatch.from_columns, greedy_is_plain) reads {unused}"
