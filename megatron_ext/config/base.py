"""Typed configs with flags and strict YAML.

Every subsystem owns one ``kw_only`` dataclass. A field becomes a command-line flag named after it
(``hidden_size`` -> ``--hidden-size``), so flag names are global: a field's name is the flag and the
YAML key (dashes or underscores both accepted in YAML). Field metadata carries the help text
(``doc(...)``) and, optionally, ``choices``. Validation lives in ``__post_init__`` and raises
``ConfigError`` naming the key.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from typing import Any, Iterable, Mapping

import yaml

# ConfigError lives in megatron_ext.errors (below the engine registry and the model families, which
# raise it); the config modules and their callers import it from here.
from megatron_ext.errors import ConfigError, one_line


class ArgumentParser(argparse.ArgumentParser):
    """``argparse`` whose errors are ``ConfigError``s: one line, no usage dump, and the nearest flag
    suggested for a misspelled one (Python 3.11's argparse suggests nothing). The caller reports
    it like any other bad input; ``--help`` still prints and exits."""

    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(suggest_flag(one_line(message), self._option_strings()))

    def _option_strings(self) -> list[str]:
        """Every documented long flag, those of sub-commands included (the top-level parser is
        the one that reports a flag no sub-command took)."""
        out = []
        for a in self._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub in a.choices.values():
                    out += sub._option_strings() if isinstance(sub, ArgumentParser) else []
            out += [o for o in a.option_strings if o.startswith("--") and a.help is not argparse.SUPPRESS]
        return list(dict.fromkeys(out))


def nearest(name: str, known: Iterable[str]) -> str | None:
    """The known flag or key ``name`` was probably meant to be, or None when none is near.

    Near means close as a whole (difflib's ratio >= 0.6) *and* sharing most words: more than half of
    ``name``'s words (split on ``-`` and ``_``) are each within one or two letters of a word of the
    candidate (ratio >= 0.8). The ratio alone pairs names that only share letters and a common word
    (``--vocab-file`` with ``--metrics-file``, ``--use-mcore-models`` with ``--helix-cost-model``)."""
    import difflib

    words = _words(name)
    for candidate in difflib.get_close_matches(name, list(known), n=5, cutoff=0.6):
        theirs = _words(candidate)
        near = sum(any(difflib.SequenceMatcher(None, w, t).ratio() >= 0.8 for t in theirs) for w in words)
        if 2 * near > len(words):
            return candidate
    return None


def _words(name: str) -> list[str]:
    return [w for w in name.replace("_", "-").split("-") if w]


def suggest_flag(message: str, known: Iterable[str]) -> str:
    """Append 'did you mean --x?' to argparse's 'unrecognized arguments: --y 3' for misspelled flags."""
    if not message.startswith("unrecognized arguments: "):
        return message
    known = list(known)
    hints = []
    for token in message.split(": ", 1)[1].split():
        flag = token.split("=", 1)[0]
        if flag.startswith("--"):
            close = nearest(flag, known)
            if close:
                hints.append((flag, close))
    if len(hints) == 1:
        return f"{message}; did you mean {hints[0][1]}?"
    if hints:
        return f"{message}; did you mean " + ", ".join(f"{c} (for {f})" for f, c in hints) + "?"
    return message


def doc(help: str, default: Any = dataclasses.MISSING, *, choices: Iterable[Any] | None = None,
        default_factory: Any = dataclasses.MISSING, aliases: Iterable[str] = (), negatives: Iterable[str] = (),
        renamed_from: str = "", repeatable: bool = False) -> Any:
    """A dataclass field with a help text (shown by ``--help`` and in docs/). ``aliases``: other
    spellings of its flag (Megatron-LM's, e.g. ``--override-opt_param-scheduler``); the YAML key
    is the field's name. ``negatives``: flags that set a bool field to False besides ``--no-<name>``
    (Megatron-LM's ``--disable-...`` spellings). ``renamed_from``: the field's former name, still taken
    as a flag and a YAML key; a run that uses it is told once which name replaced it (``renamed_keys``).
    ``repeatable``: a list field whose flag, given twice, adds to the values (``--inject-slow A
    --inject-slow B``); without it the last occurrence replaces the others, as argparse (and
    Megatron-LM) do."""
    meta: dict[str, Any] = {"help": help}
    if choices is not None:
        meta["choices"] = tuple(choices)
    if aliases:
        meta["aliases"] = tuple(aliases)
    if negatives:
        meta["negatives"] = tuple(negatives)
    if renamed_from:
        meta["renamed_from"] = renamed_from
    if repeatable:
        meta["repeatable"] = True
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(scalar type, optional?) of an annotation such as ``int | None`` or ``list[int]``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            inner, _ = _base_type(args[0])
            return inner, True
    return tp, False


def _resolved_fields(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls) if f.init]


def _parse_bool(text: str) -> bool:
    low = str(text).lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def add_flags(parser: argparse.ArgumentParser, cls: type, title: str | None = None) -> None:
    """Add one flag per field of ``cls``. Defaults are ``None`` so that only flags given on the
    command line override YAML; the dataclass default applies when neither gives a value."""
    group = parser.add_argument_group(title or cls.__name__, (cls.__doc__ or "").strip().split("\n")[0])
    for f, tp in _resolved_fields(cls):
        base, _optional = _base_type(tp)
        help_text = f.metadata.get("help", "")
        default = f.default if f.default is not dataclasses.MISSING else None
        if default is not None and default != "":
            help_text += f" (default: {default})"
        kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": help_text}
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        if f.metadata.get("repeatable"):
            kwargs["action"] = "extend"
        names = (flag_name(f.name), *f.metadata.get("aliases", ()))
        _add_flag(group, names, f.name, base, kwargs)
        negatives = f.metadata.get("negatives", ())
        if negatives:
            group.add_argument(*negatives, dest=f.name, action="store_const", const=False, default=None,
                               help=argparse.SUPPRESS)
        old = f.metadata.get("renamed_from")
        if old:
            # The former spelling lands in its own destination, so that the parse can tell which
            # name the user wrote (``renamed_keys``) and refuse both at once.
            _add_flag(group, (flag_name(old),), old, base, {**kwargs, "dest": old, "help": argparse.SUPPRESS})


def _add_flag(group: Any, names: tuple[str, ...], field: str, base: Any, kwargs: dict[str, Any]) -> None:
    if base is bool:
        # --flag, --flag true/false, and --no-flag all work.
        group.add_argument(*names, nargs="?", const=True, type=_parse_bool, **kwargs)
        group.add_argument("--no-" + field.replace("_", "-"), dest=kwargs["dest"], action="store_const",
                           const=False, default=None, help=argparse.SUPPRESS)
    elif typing.get_origin(base) in (list, tuple):
        (elem,) = set(typing.get_args(base)) - {Ellipsis} or {str}
        group.add_argument(*names, nargs="+", type=elem, **kwargs)
    else:
        group.add_argument(*names, type=base if base in (int, float, str) else str, **kwargs)


def renames(classes: Iterable[type]) -> dict[str, str]:
    """Former field name -> the field that replaced it, over ``classes``."""
    return {f.metadata["renamed_from"]: f.name for cls in classes for f, _ in _resolved_fields(cls)
            if f.metadata.get("renamed_from")}


def renamed_keys(values: Mapping[str, Any], renamed: Mapping[str, str], where: str) -> tuple[dict[str, Any], list[str]]:
    """``values`` with former names written as the new ones, and one note per former name used
    (``--resihp-on-stop is now --ft-on-stop``). Both names given at once is an error naming both."""
    out = dict(values)
    notes = []
    for old, new in renamed.items():
        if out.get(old) is None:
            out.pop(old, None)
            continue
        if out.get(new) is not None:
            raise ConfigError(f"{where}: {flag_name(old)} and {flag_name(new)} are one setting "
                              f"({flag_name(old)} is its former name): give {flag_name(new)} only")
        out[new] = out.pop(old)
        notes.append(f"{flag_name(old)} is now {flag_name(new)} (the former name still works)")
    return out, notes


def _coerce(value: Any, tp: Any, key: str, where: str) -> Any:
    base, optional = _base_type(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where}: key '{key}' must not be null")
    try:
        if base is bool:
            if isinstance(value, bool):
                return value
            return _parse_bool(value)
        if base is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if base is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if base is str:
            if isinstance(value, (dict, list)):
                raise ValueError
            return str(value)
        origin = typing.get_origin(base)
        if origin in (list, tuple):
            (elem,) = set(typing.get_args(base)) - {Ellipsis} or {str}
            items = value if isinstance(value, (list, tuple)) else [value]
            return origin(_coerce(v, elem, key, where) for v in items)
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        raise ConfigError(f"{where}: key '{key}' expects {getattr(base, '__name__', base)}, "
                          f"got {value!r}") from None
    return value


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Read a flat YAML mapping; keys normalised to underscores. Errors name the file."""
    return load_yaml_node(path)[0]


def load_yaml_node(path: str | os.PathLike) -> tuple[dict[str, Any], yaml.Node | None]:
    """:func:`load_yaml`'s mapping and the node tree it was built from, from one read of the file:
    the nodes keep each key's line (``start_mark``) for errors that name it."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path} does not exist")
    try:
        with open(path, encoding="utf-8") as fh:
            loader = yaml.SafeLoader(fh)   # what yaml.safe_load does, keeping the node
            try:
                root = loader.get_single_node()
                data = None if root is None else loader.construct_document(root)
            finally:
                loader.dispose()
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if data is None:
        return {}, root
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: top level must be a mapping of key: value, got {type(data).__name__}")
    out: dict[str, Any] = {}
    for key, value in data.items():
        norm = str(key).replace("-", "_")
        if norm in out:
            raise ConfigError(f"{path}: key '{key}' given twice")
        out[norm] = value
    return out, root


def build(cls: type, values: Mapping[str, Any], where: str) -> Any:
    """Instantiate ``cls`` from the subset of ``values`` it owns, coercing types; errors name ``where``."""
    kwargs = {}
    for f, tp in _resolved_fields(cls):
        if f.name in values and values[f.name] is not None:
            kwargs[f.name] = value = _coerce(values[f.name], tp, f.name, where)
            choices = f.metadata.get("choices")
            # argparse checks choices for flags only; a YAML value gets the same check here.
            if choices is not None and value not in choices:
                raise ConfigError(f"{where}: key '{f.name}' must be one of "
                                  f"{', '.join(repr(c) for c in choices)}, got {value!r}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except TypeError as exc:  # a required field missing
        raise ConfigError(f"{where}: {exc}") from None


def field_names(cls: type) -> list[str]:
    return [f.name for f, _ in _resolved_fields(cls)]


def check_unknown(values: Mapping[str, Any], known: Iterable[str], where: str) -> None:
    known = set(known)
    unknown = sorted(k for k in values if k not in known)
    if unknown:
        hints = []
        for k in unknown:
            close = nearest(k, known)
            hints.append(f"'{k}'" + (f" (did you mean '{close}'?)" if close else ""))
        raise ConfigError(f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(hints)}")


def to_dict(cfg: Any) -> dict[str, Any]:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
