"""What the scheduler reads of a model folder's `generation_config.json`.

Instruct models list their end-of-turn token there (Llama-3-Instruct's 128009), beside config.json's
end-of-text id, so the ids that end a sequence are the union of both files'. When the file asks for
sampling (`do_sample: true`), its `temperature` and `top_p` become the defaults of requests that leave
those fields unset (as `generate` does); `top_k` is not taken, since a request's top_k of 0 cannot be
told apart from an unset one. A value the server could not honour is skipped with a warning.
"""

from __future__ import annotations

import json
import logging
import math
import pathlib
from dataclasses import dataclass

_log = logging.getLogger(__name__)
FILE_NAME = "generation_config.json"


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    eos_token_ids: tuple[int, ...] = ()
    sampling: tuple[tuple[str, float], ...] = ()  # (SamplingParams field, value) for unset fields

    @classmethod
    def from_dir(cls, model_dir: str | pathlib.Path) -> GenerationDefaults:
        path = pathlib.Path(model_dir) / FILE_NAME
        if not path.is_file():
            return cls()
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            _log.warning("%s ignored: %s", path, err)
            return cls()
        if not isinstance(raw, dict):
            _log.warning("%s ignored: not a JSON object", path)
            return cls()
        return cls(eos_token_ids=_eos_ids(raw.get("eos_token_id"), path), sampling=_sampling(raw, path))


def _eos_ids(value: object, path: pathlib.Path) -> tuple[int, ...]:
    ids = value if isinstance(value, list) else ([] if value is None else [value])
    good = tuple(i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0)
    if len(good) != len(ids):
        _log.warning("%s: eos_token_id %r: only non-negative integers are used", path, value)
    return good


def _sampling(raw: dict, path: pathlib.Path) -> tuple[tuple[str, float], ...]:
    if raw.get("do_sample") is not True:
        return ()
    checks = {"temperature": lambda v: 0.0 <= v <= 100.0, "top_p": lambda v: 0.0 < v <= 1.0}
    out = []
    for name, ok in checks.items():
        value = raw.get(name)
        if value is None:
            continue
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not is_number or not math.isfinite(value) or not ok(value):
            _log.warning("%s: %s %r ignored (out of range)", path, name, value)
            continue
        out.append((name, float(value)))
    return tuple(out)


def union_ids(*id_lists: tuple[int, ...]) -> tuple[int, ...]:
    """The ids of every list, each once, in first-seen order."""
    return tuple(dict.fromkeys(i for ids in id_lists for i in ids))
