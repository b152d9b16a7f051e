"""Command-line flags generated from config dataclasses: each serving option is declared once, as a
field of the dataclass that owns it, and becomes a flag of every process that takes that config.

    block_size: int = option(16, "tokens per KV cache block")
        -> --block-size BLOCK_SIZE   (type from the annotation, default from the field, shown by --help)

Field name -> `--kebab-name` (or `flag=` / `aliases=`); `bool` -> `--x / --no-x`; `X | None` takes X
(and `none` where X is not str); `tuple[X, ...]` is comma-separated; `choices=` and `help=` come
from the field's metadata (`option()` writes it); `cli=False` keeps a field off the command line. A
field whose type is a dataclass contributes that dataclass's flags (composition). `borrow()` takes a
field (default, help, choices) from the dataclass that owns it, so a process config that repeats
an option (the scheduler server's `max_num_seqs`, SchedulerConfig's) does not repeat its default.

`from_args(cls, namespace)` builds the config back from parsed flags; `to_argv(config, cls)` renders
a config as the flags of a child process (what a launcher passes on), so the launcher re-declares
nothing. `parse_args_with_config` adds `--config FILE`: a JSON object of flag values supplying the
defaults. No torch here: both services import this module.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

MISSING: Any = dataclasses.MISSING


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default, except where there is none (required) or the help says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def option(
    default: Any = MISSING,
    help: str = "",
    *,
    choices: Sequence[Any] | None = None,
    flag: str | None = None,
    aliases: Sequence[str] = (),
    cli: bool = True,
    **field_kwargs: Any,
) -> Any:
    """A dataclass field that is also a command-line flag. `flag`: the long name without `--` (default:
    the field name in kebab case); `aliases`: more option strings, with their dashes."""
    metadata = {"help": help, "choices": tuple(choices) if choices is not None else None,
                "flag": flag, "aliases": tuple(aliases), "cli": cli}
    return dataclasses.field(default=default, metadata=metadata, **field_kwargs)


def borrow(owner: type, name: str, **changes: Any) -> Any:
    """The field `name` of the dataclass `owner` (default and flag metadata), for another config that
    takes the same option; `changes` override the metadata (help=..., flag=...)."""
    source = {f.name: f for f in dataclasses.fields(owner)}[name]
    return dataclasses.field(default=source.default, metadata={**source.metadata, **changes})


@dataclasses.dataclass(frozen=True, slots=True)
class FlagSpec:
    """One generated flag: the field at `path` (names from the root config through nested ones)."""

    path: tuple[str, ...]
    option_strings: tuple[str, ...]  # first the canonical `--name`, then the aliases
    kind: type  # int | float | str | bool | tuple
    item_kind: type  # the element type of a tuple; else kind
    optional: bool  # `X | None`
    default: Any  # MISSING: a required flag
    help: str
    choices: tuple[Any, ...] | None

    @property
    def dest(self) -> str:
        return self.path[-1]

    @property
    def flag(self) -> str:
        return self.option_strings[0]


def flag_specs(cls: type, exclude: Iterable[str] = ()) -> list[FlagSpec]:
    """The flags of dataclass `cls`, in field order; nested dataclass fields expand in place.
    `exclude`: field names (at any depth) left out."""
    excluded = set(exclude)
    specs: list[FlagSpec] = []
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if field.name in excluded or not field.metadata.get("cli", True):
            continue
        annotation = hints[field.name]
        if dataclasses.is_dataclass(annotation):
            nested = flag_specs(typing.cast(type, annotation), excluded)
            specs += [dataclasses.replace(s, path=(field.name, *s.path)) for s in nested]
            continue
        kind, item_kind, optional = _kinds(cls, field.name, annotation)
        flag = "--" + (field.metadata.get("flag") or field.name.replace("_", "-"))
        specs.append(FlagSpec(
            path=(field.name,),
            option_strings=(flag, *field.metadata.get("aliases", ())),
            kind=kind,
            item_kind=item_kind,
            optional=optional,
            default=field.default,
            help=field.metadata.get("help", ""),
            choices=field.metadata.get("choices"),
        ))
    return specs


def _kinds(cls: type, name: str, annotation: Any) -> tuple[type, type, bool]:
    args = typing.get_args(annotation)
    optional = isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union
    if optional:
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1 or len(args) != 2:
            raise TypeError(f"{cls.__name__}.{name}: only `X | None` unions become flags")
        annotation, args = rest[0], typing.get_args(rest[0])
    if typing.get_origin(annotation) is tuple:
        if len(args) != 2 or args[1] is not Ellipsis or args[0] not in (str, int, float):
            raise TypeError(f"{cls.__name__}.{name}: tuples become flags as tuple[str | int | float, ...]")
        return tuple, args[0], optional
    if annotation not in (int, float, str, bool):
        raise TypeError(f"{cls.__name__}.{name}: no flag for type {annotation!r} (cli=False keeps it off)")
    return annotation, annotation, optional


def add_arguments(parser: argparse.ArgumentParser, cls: type, exclude: Iterable[str] = ()) -> list[FlagSpec]:
    """Adds the flags of `cls` to `parser` (dest: the field name) and returns their specs. A flag whose
    dest the parser has already (another config's field of the same name) is shared, not added again."""
    parser.formatter_class = HelpFormatter
    taken = {action.dest for action in parser._actions}
    specs = [s for s in flag_specs(cls, exclude) if s.dest not in taken]
    for spec in specs:
        kwargs: dict[str, Any] = {"dest": spec.dest, "help": spec.help or " "}
        if spec.default is MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = spec.default
        if spec.kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _parser_of(spec)
            if spec.choices is not None:
                kwargs["choices"] = spec.choices
            if spec.choices is None:
                kwargs["metavar"] = spec.flag[2:].upper().replace("-", "_")
            if spec.kind is tuple:
                kwargs["metavar"] = f"{spec.item_kind.__name__.upper()}[,...]"
        parser.add_argument(*spec.option_strings, **kwargs)
    return specs


def _parser_of(spec: FlagSpec) -> Callable[[str], Any]:
    item, kind, none_word = spec.item_kind, spec.kind, spec.optional and spec.item_kind is not str

    def parse(text: str) -> Any:
        if none_word and text.lower() == "none":
            return None
        if kind is tuple:
            return tuple(item(part) for part in text.split(",") if part)
        return item(text)

    parse.__name__ = item.__name__  # argparse names the type in its error messages
    return parse


def from_args(
    cls: type, namespace: argparse.Namespace | Mapping[str, Any], exclude: Iterable[str] = (),
    **overrides: Any,
) -> Any:
    """An instance of `cls` from parsed flags (attribute = field name; nested dataclasses from the same
    flat namespace); `overrides` win; fields without a flag, or `exclude`d, take their defaults."""
    values = namespace if isinstance(namespace, Mapping) else vars(namespace)
    excluded = set(exclude)
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if field.name in overrides:
            kwargs[field.name] = overrides[field.name]
        elif dataclasses.is_dataclass(hints[field.name]):
            kwargs[field.name] = from_args(typing.cast(type, hints[field.name]), values, excluded)
        elif field.metadata.get("cli", True) and field.name in values and field.name not in excluded:
            kwargs[field.name] = values[field.name]
    unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise TypeError(f"{cls.__name__} has no field {sorted(unknown)}")
    return cls(**kwargs)


def to_argv(config: Any, cls: type | None = None, exclude: Iterable[str] = ()) -> list[str]:
    """The flags of `cls` (default: the config's class) that give `config`'s values to a process
    parsing them: `config` is a `cls` instance or any object with attributes named like the fields
    (e.g. a launcher's namespace). Values equal to the field's default are left out."""
    cls = cls or type(config)
    argv: list[str] = []
    for spec in flag_specs(cls, exclude):
        value = _value_at(config, spec)
        if spec.default is not MISSING and value == spec.default:
            continue
        if spec.kind is bool:
            name = spec.flag if value else "--no-" + spec.flag[2:]
            argv.append(name)
        elif value is None:
            argv += [spec.flag, "none"]
        elif spec.kind is tuple:
            argv += [spec.flag, ",".join(str(item) for item in value)]
        else:
            argv += [spec.flag, str(value)]
    return argv


def _value_at(config: Any, spec: FlagSpec) -> Any:
    node = config
    for name in spec.path:
        if not hasattr(node, name):
            return getattr(config, spec.dest)  # a flat object (namespace) for a nested config
        node = getattr(node, name)
    return node


def parse_args_with_config(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse `argv`, with `--config FILE` (JSON whose keys are the parser's long flags with
    underscores: `max_num_seqs` for `--max-num-seqs`) supplying defaults; flags on the command line
    override it. An unknown key is an error naming it. A list value (e.g. `executors`) becomes a
    comma-separated string; a switch takes true/false (`no_prefix_caching: true` = prefix caching off)."""
    parser.add_argument("--config", default=None, metavar="FILE", help="JSON file of flag values")
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    path = pre.parse_known_args(argv)[0].config
    if path:
        try:
            values = json.loads(pathlib.Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            parser.error(f"--config {path}: {err}")
        if not isinstance(values, dict):
            parser.error(f"--config {path}: expected a JSON object of flag values")
        by_key = {opt[2:].replace("-", "_"): (opt, action) for action in parser._actions
                  for opt in action.option_strings if opt.startswith("--")}
        for key, value in values.items():
            opt, action = by_key.get(key, ("", None))
            if action is None or key in ("config", "help"):
                parser.error(f"--config {path}: unknown key {key!r} (keys are the flags, e.g. max_num_seqs)")
            if action.nargs == 0 and not isinstance(value, bool):
                parser.error(f"--config {path}: {key} must be true or false")
            if isinstance(action, argparse.BooleanOptionalAction) and opt.startswith("--no-"):
                value = not value
            if isinstance(value, list):
                value = ",".join(str(v) for v in value)
            action.required = False
            parser.set_defaults(**{action.dest: value})
    return parser.parse_args(argv)
