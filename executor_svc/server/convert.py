"""The worker's description → protobuf (Describe). Step plans and results: scheduler_svc.wire.convert."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from protos.pagedserve.v1 import executor_pb2

_FIELDS = [f.name for f in executor_pb2.DescribeResponse.DESCRIPTOR.fields if f.name != "extra_json"]
# Names the worker may use for a field of DescribeResponse.
_ALIASES = {"max_model_len": ("max_model_len", "max_seq_len"), "model_name": ("model_name", "model", "name")}


def _as_dict(info: Any) -> dict[str, Any]:
    if isinstance(info, dict):
        return dict(info)
    if dataclasses.is_dataclass(info):
        return {f.name: getattr(info, f.name) for f in dataclasses.fields(info)}
    return {k: v for k, v in vars(info).items() if not k.startswith("_")}


def _flatten(values: dict[str, Any]) -> dict[str, Any]:
    """Nested descriptions (e.g. a model config inside a worker description) become one level."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            for inner_key, inner in _flatten(_as_dict(value)).items():
                flat.setdefault(inner_key, inner)
        else:
            flat[key] = value
    return flat


def describe_to_pb(info: Any) -> executor_pb2.DescribeResponse:
    values = _flatten(_as_dict(info))
    msg = executor_pb2.DescribeResponse()
    used = set()
    for name in _FIELDS:
        for alias in _ALIASES.get(name, (name,)):
            if values.get(alias) is not None:
                value = values[alias]
                if name == "eos_token_ids":
                    msg.eos_token_ids.extend(value)
                else:
                    setattr(msg, name, type(getattr(msg, name))(value))
                used.add(alias)
                break
    extra = {k: v for k, v in values.items() if k not in used}
    msg.extra_json = json.dumps(extra, default=str, sort_keys=True)
    return msg

