"""kvinject's settings: what each part of a deployment (the vLLM connector,
the HTTP gateway) reads, from one place.

Three layers, per key, the first that has it winning:

1. explicit values (the connector: vLLM's ``kv_connector_extra_config``; the
   gateway: its command line);
2. environment variables ``KVINJECT_<SECTION>_<KEY>`` (the key upper-case:
   ``KVINJECT_CONNECTOR_STORE_BUDGET_MB=512``);
3. a YAML file named by ``KVINJECT_CONFIG_FILE``, with one top-level mapping
   per part::

       connector:
         store_budget_mb: 512
         store_path: /var/lib/memory/facts.kvi
       gateway:
         port: 8100

4. and the field's default.

Each part declares its keys as :class:`Field` s and calls :func:`resolve`.
Everything is checked: a value of the wrong type or out of range, an unknown
key in the part's section, an unknown ``KVINJECT_<SECTION>_*`` variable, an
unknown top-level section of the file are refused with a ValueError naming the
key, where it came from (the file's path, the variable, the explicit layer)
and the keys known. Environment strings are parsed to the field's type (bool:
1/0/true/false/yes/no; dict and list: JSON; an empty string is None for a
field whose default is None).

PyYAML is imported only when a file is named (vLLM's environment has it).
No vLLM import here.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

#: the environment variable naming the YAML file
CONFIG_FILE_VAR = "KVINJECT_CONFIG_FILE"
#: the file's top-level sections, one per part of a deployment
SECTIONS = ("connector", "gateway")

_TRUE = ("1", "true", "yes")
_FALSE = ("0", "false", "no")
_TYPE_NAMES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string", dict: "a mapping",
               list: "a list"}


def env_var(section: str, key: str) -> str:
    """The environment variable of a key: ``KVINJECT_<SECTION>_<KEY>``."""
    return "KVINJECT_%s_%s" % (section.upper(), key.upper())


@dataclass(frozen=True)
class Field:
    """One setting: its name (the key in every layer), type (int, float, bool,
    str, dict or list), default (None: the setting may be None, "not set"),
    inclusive range ``lo``..``hi`` (numbers), allowed ``choices`` and a line of
    documentation."""

    name: str
    type: type
    default: Any = None
    lo: Optional[float] = None
    hi: Optional[float] = None
    choices: Optional[Sequence[Any]] = None
    doc: str = ""

    def __post_init__(self):
        if self.type not in _TYPE_NAMES:
            raise TypeError("Field %r: type must be one of int, float, bool, str, dict, list; got %r"
                            % (self.name, self.type))
        if self.default is not None:
            self.check(self.default, "the default")

    def check(self, value: Any, source: str) -> Any:
        """``value`` checked against the type, range and choices (an int is taken
        for a float); raises ValueError naming the key and ``source``."""
        if value is None:
            if self.default is None:
                return None
            raise ValueError("kvinject settings: %s (from %s) must be %s, got None"
                             % (self.name, source, _TYPE_NAMES[self.type]))
        t = self.type
        ok = isinstance(value, t) and not (t is int and isinstance(value, bool))
        if t is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if t is dict:
            ok = isinstance(value, Mapping)
            value = dict(value) if ok else value
        if not ok:
            raise ValueError("kvinject settings: %s (from %s) must be %s, got %r (%s)"
                             % (self.name, source, _TYPE_NAMES[t], value, type(value).__name__))
        if t is float and math.isnan(value):
            raise ValueError("kvinject settings: %s (from %s) is NaN" % (self.name, source))
        if (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
            raise ValueError("kvinject settings: %s (from %s) = %r is out of range (%s)"
                             % (self.name, source, value, self.range_text()))
        if self.choices is not None and value not in self.choices:
            raise ValueError("kvinject settings: %s (from %s) = %r is not one of %s"
                             % (self.name, source, value, ", ".join(repr(c) for c in self.choices)))
        return value

    def range_text(self) -> str:
        """The range as "lo..hi", ">= lo" or "<= hi" ("" for none)."""
        if self.lo is not None and self.hi is not None:
            return "%r..%r" % (self.lo, self.hi)
        if self.lo is not None:
            return ">= %r" % (self.lo,)
        return "<= %r" % (self.hi,) if self.hi is not None else ""

    def parse(self, text: str, source: str) -> Any:
        """An environment string as the field's type, then checked."""
        t = self.type
        if text == "" and self.default is None:
            return None
        try:
            if t is bool:
                low = text.strip().lower()
                if low not in _TRUE + _FALSE:
                    raise ValueError
                value: Any = low in _TRUE
            elif t is int:
                value = int(text.strip(), 10)
            elif t is float:
                value = float(text)
            elif t in (dict, list):
                value = json.loads(text)
            else:
                value = text
        except ValueError:
            want = "1/0/true/false/yes/no" if t is bool else ("JSON" if t in (dict, list) else _TYPE_NAMES[t])
            raise ValueError("kvinject settings: %s (from %s) must be %s, got %r" % (self.name, source, want, text)) \
                from None
        return self.check(value, source)


def load_file(environ: Mapping[str, str] = os.environ) -> Optional[Dict[str, Any]]:
    """The YAML file that ``KVINJECT_CONFIG_FILE`` names, as its top-level
    mapping (sections checked against SECTIONS), or None when none is named."""
    path = environ.get(CONFIG_FILE_VAR)
    if not path:
        return None
    try:
        import yaml
    except ImportError:
        raise ValueError("kvinject settings: %s names %s, but PyYAML is not installed (pip install pyyaml; "
                         "vLLM's environment has it)" % (CONFIG_FILE_VAR, path)) from None
    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
    except OSError as e:
        raise ValueError("kvinject settings: cannot read %s (named by %s): %s"
                         % (path, CONFIG_FILE_VAR, e.strerror or e)) from None
    except yaml.YAMLError as e:
        raise ValueError("kvinject settings: %s (named by %s) is not valid YAML: %s"
                         % (path, CONFIG_FILE_VAR, str(e).replace("\n", " "))) from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ValueError("kvinject settings: %s (named by %s) must hold a mapping of sections (%s), got %s"
                         % (path, CONFIG_FILE_VAR, ", ".join(SECTIONS), type(doc).__name__))
    unknown = sorted(str(k) for k in doc if k not in SECTIONS)
    if unknown:
        raise ValueError("kvinject settings: unknown section(s) %s in %s (named by %s; known: %s)"
                         % (", ".join(unknown), path, CONFIG_FILE_VAR, ", ".join(SECTIONS)))
    return doc


def _unknown(keys: Iterable[Any], known: Dict[str, Field], where: str) -> None:
    bad = sorted(str(k) for k in keys if k not in known)
    if bad:
        raise ValueError("kvinject settings: unknown key(s) %s in %s (known: %s)"
                         % (", ".join(bad), where, ", ".join(sorted(known))))


def resolve(section: str, fields: Sequence[Field], explicit: Optional[Mapping[str, Any]] = None,
            environ: Mapping[str, str] = os.environ, explicit_source: str = "explicit settings") -> Dict[str, Any]:
    """Every field of ``section`` resolved: explicit > environment > file >
    default. ``explicit_source`` names the explicit layer in messages (the
    connector: "kv_connector_extra_config"). Returns {name: value} for every
    field; raises ValueError naming the key, its source and the known keys."""
    if section not in SECTIONS:
        raise ValueError("kvinject settings: unknown section %r (known: %s)" % (section, ", ".join(SECTIONS)))
    known: Dict[str, Field] = {}
    for f in fields:
        if f.name in known:
            raise ValueError("kvinject settings: field %r declared twice in section %s" % (f.name, section))
        known[f.name] = f
    out = {name: f.default for name, f in known.items()}

    doc = load_file(environ)
    if doc is not None:
        path = environ[CONFIG_FILE_VAR]
        part = doc.get(section)
        if part is None:
            part = {}
        if not isinstance(part, dict):
            raise ValueError("kvinject settings: section %s of %s must be a mapping, got %s"
                             % (section, path, type(part).__name__))
        where = "section %s of %s" % (section, path)
        _unknown(part, known, where)
        for k, v in part.items():
            out[k] = known[k].check(v, where)

    prefix = "KVINJECT_%s_" % section.upper()
    env_known = {env_var(section, n): n for n in known}
    for var in sorted(environ):
        if not var.startswith(prefix):
            continue
        name = env_known.get(var)
        if name is None:
            raise ValueError("kvinject settings: unknown variable %s (section %s; known: %s)"
                             % (var, section, ", ".join(sorted(env_known))))
        out[name] = known[name].parse(environ[var], var)

    if explicit is not None:
        if not isinstance(explicit, Mapping):
            raise ValueError("kvinject settings: %s must be a mapping, got %s"
                             % (explicit_source, type(explicit).__name__))
        _unknown(explicit, known, explicit_source)
        for k, v in explicit.items():
            out[k] = known[k].check(v, explicit_source)
    return out


def describe(section: str, fields: Sequence[Field]) -> List[Dict[str, Any]]:
    """The fields as rows for documentation: name, type, range, choices,
    default, environment variable, doc."""
    rows = []
    for f in fields:
        rows.append(dict(name=f.name, type=f.type.__name__, range=f.range_text(),
                         choices=list(f.choices) if f.choices is not None else None, default=f.default,
                         env=env_var(section, f.name), doc=f.doc))
    return rows
