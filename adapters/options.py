"""The rendezvous options (``--rdzv-conf`` keys, torch's ``RendezvousParameters``
config): one typed table, :data:`TABLE`, and everything derived from it.

Each :class:`Option` says what a key is: its type (which names its one coercion,
:data:`COERCE`, and so the message a bad value gets), its default, which backends
read it (rallypoint's and torch 2.13's), whether it sets a field of the core's
:class:`~rallypoint.core.Settings`, which launcher flag sets it, whether it asks for
a protected connection, and what its docs say. Derived from the table, never
written twice: which keys each backend reads (:data:`OPTIONS`,
:data:`TORCH_OPTIONS`), the rule that sorts a config's keys into read, ignored with
a warning and refused (:func:`check_options`), the values of the core's settings
(:func:`settings_values`), and the docs' table of options
(:func:`render_docs_table`, docs/adapters.md; a test keeps the two equal).

The walk goes down only: the launcher's flags -> :mod:`rallypoint.adapters.config`
(which checks torch's parameters with this table) -> the core's ``Settings``.
Nothing here imports torch, nor the core until settings are made.

This module also holds the error type of every configuration check,
:class:`ConfigError`, and the duration check (:func:`check_seconds`), since the
options' coercions raise and use them; :mod:`rallypoint.adapters.config` exports
both, as before.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "COERCE",
    "MAX_SECONDS",
    "OPTIONS",
    "SETTING",
    "TABLE",
    "TORCH_OPTIONS",
    "WHERE",
    "ConfigError",
    "Option",
    "check_options",
    "check_seconds",
    "coerce",
    "ignored_meaning",
    "option",
    "render_docs_table",
    "replace_table",
    "settings_values",
    "torch_options",
]

#: Longest duration a seconds option takes (a week): the store clients' timeouts
#: overflow long before infinity, and nobody means them.
MAX_SECONDS = 7 * 24 * 3600.0


class ConfigError(ValueError):
    """A configuration value is invalid: a launch flag, or a rendezvous backend,
    endpoint, run id or option. The message is one line that names it and says
    what is accepted."""


def check_seconds(value: float, option: str, *, allow_zero: bool = False) -> float:
    """Return ``value`` if it is a duration up to :data:`MAX_SECONDS` (more than 0,
    or at least 0 with ``allow_zero``).

    Raises:
        ConfigError: NaN, infinite or out of range.
    """
    if allow_zero:
        ok, accepted = value >= 0, f"between 0 and {MAX_SECONDS:.0f} seconds"
    else:
        ok, accepted = value > 0, f"more than 0 and at most {MAX_SECONDS:.0f} seconds"
    # NaN fails every comparison, infinity the upper bound.
    if not (ok and value <= MAX_SECONDS):
        raise ConfigError(f"{option} must be {accepted}, got {value}")
    return value


#: Where a bad value is named in messages (``rendezvous option join_timeout='x' ...``).
WHERE = "rendezvous option"

#: Marks a default that is the core's ``Settings`` field of the same name (read
#: from the core when settings are made, never copied here).
SETTING: Any = object()

# Reader names. rallypoint's: the kinds of store, and the embedded etcd, which
# reads the etcd backend's keys but its users' and two of its own.
_C10D, _ETCD, _EMBEDDED = "c10d", "etcd", "etcd-embedded"
_OURS = frozenset({_C10D, _ETCD, _EMBEDDED})
_OUR_ETCD = frozenset({_ETCD, _EMBEDDED})
# torch's: its dynamic rendezvous on the c10d and etcd-v2 stores, its etcd-v1
# rendezvous (``etcd``) and its static one.
_DYNAMIC = ("c10d", "etcd-v2")


@dataclass(frozen=True)
class Option:
    """One rendezvous option.

    Attributes:
        name: the key (``--rdzv-conf name=value``).
        type: how a given value is read: a key of :data:`COERCE` (``seconds``,
            ``count``, ``flag``, ``budget``, ``choice``, ``text``, ``file``), or
            ``torch`` for a key only torch's handlers read (rallypoint never
            reads its value).
        default: the value when the key is not given (:data:`SETTING`: the core's
            ``Settings`` default).
        ours: rallypoint's readers: ``c10d``, ``etcd``, ``etcd-embedded``.
        torch: torch 2.13's readers (``c10d``, ``etcd-v2``: its dynamic rendezvous;
            ``etcd``: its etcd-v1 rendezvous; ``static``), as torch's source reads
            them (a test checks).
        setting: the key sets the core ``Settings`` field of its name.
        choices: the accepted values of a ``choice`` (lower case).
        flag: the launcher flag that sets the key; ``rallypoint run`` then refuses
            it in ``--rdzv-conf``, naming the flag, unless ``flag_refuses`` is
            False (the flag's value is passed instead and the key is ignored).
        protects: the key asks for a protected connection (True), or does with
            one of these values (``protocol=https``): a backend that does not read
            it refuses it, since the connection would not be protected as asked.
        alias_of: the key is torch's other name for this one.
        ignored: what the warning about the key on a backend that ignores it says
            (default: which backends read it).
        torchrun_adds: torch's launcher adds the key to every backend's parameters,
            whatever the user wrote (the handler then notes it ignored quietly).
        doc: its meaning in docs/adapters.md's table (rallypoint's keys; keys in a
            row with the same text share a row).
        doc_default: the default as the docs show it, where the value does not say
            it (``inferred``).
    """

    name: str
    type: str
    default: Any = None
    ours: frozenset[str] = frozenset()
    torch: tuple[str, ...] = ()
    setting: bool = False
    choices: tuple[str, ...] = ()
    flag: str | None = None
    flag_refuses: bool = True
    protects: bool | frozenset[str] = False
    alias_of: str | None = None
    ignored: str = ""
    torchrun_adds: bool = False
    doc: str = ""
    doc_default: str = ""

    def asks_for_protection(self, value: object) -> bool:
        """Whether ``value`` for this key asks for a protected connection."""
        if isinstance(self.protects, bool):
            return self.protects
        return str(value).strip().lower() in self.protects


_TLS_DOC = (
    "etcd over TLS (torch's names; `ca_cert`, `ssl_cert`, `ssl_cert_key` also accepted); an "
    "`https://` endpoint means `protocol=https`, and so do `cacert`/`cert`/`key` given without "
    "`protocol`. See `docs/security.md`"
)

#: Every rendezvous option some backend reads, rallypoint's or torch's; the docs'
#: table follows this order. A new option is a new row here, and nothing else.
TABLE: tuple[Option, ...] = (
    # --- the c10d store
    Option("is_host", "flag", None, frozenset({_C10D}), ("c10d",), doc_default="inferred",
           doc="c10d/tcp: this node hosts the TCPStore server. Unset: host if the endpoint "
           "names this machine (if two local processes both infer it, the one that loses the "
           "bind becomes a client). Port 0 with `is_host` binds a free port; "
           "`handler.endpoint` tells which."),
    Option("store_type", "choice", "tcp", frozenset({_C10D}), ("c10d",), choices=("tcp", "file"),
           doc="c10d: `tcp` or `file` (the endpoint is then a file path)"),
    # --- every backend
    Option("read_timeout", "seconds", 60.0, _OURS, _DYNAMIC,
           doc="seconds for a store/etcd operation; for etcd how long every call rides out an "
           "unreachable, stopped or leaderless cluster (retrying, failing over between the "
           "members) before raising `RendezvousConnectionError`"),
    Option("join_timeout", "seconds", SETTING, _OURS, _DYNAMIC, setting=True, doc="as torch"),
    Option("last_call_timeout", "seconds", SETTING, _OURS, ("c10d", "etcd", "etcd-v2"),
           setting=True, doc="as torch"),
    Option("close_timeout", "seconds", SETTING, _OURS, _DYNAMIC, setting=True, doc="as torch"),
    Option("heartbeat_timeout", "seconds", SETTING, _OURS, _DYNAMIC, setting=True,
           doc="as torch"),
    Option("keep_alive_interval", "seconds", SETTING, _OURS, _DYNAMIC, setting=True,
           doc="heartbeat period; a peer is dead after `interval * attempts` without its "
           "counter moving"),
    Option("keep_alive_max_attempt", "count", SETTING, _OURS, _DYNAMIC, setting=True,
           doc="heartbeat period; a peer is dead after `interval * attempts` without its "
           "counter moving"),
    Option("stable_ranks", "flag", SETTING, _OURS, setting=True,
           doc="a surviving node keeps its rank across rounds where it can"),
    Option("restart_budget", "budget", SETTING, _OURS, setting=True,
           flag="--restart-scope job (with --max-restarts)",
           doc="failure-caused rounds the whole job may start (a job-wide `--max-restarts`; "
           "none: each agent counts its own, as torch). `rallypoint run` refuses the key: "
           "`--restart-scope job` with `--max-restarts`"),
    Option("exclusion_rounds", "count", SETTING, _OURS, setting=True, flag="--exclusion-rounds",
           doc="rounds a node that excluded itself sits out, standing by as a spare. "
           "`rallypoint run` refuses the key: `--exclusion-rounds`"),
    Option("local_addr", "text", None, _OURS, flag="--local-addr",
           doc_default="`params.local_addr` or the FQDN",
           doc="node identity and the host of the per-round workers' store"),
    # --- the etcd backends
    Option("ttl", "seconds", None, _OUR_ETCD,
           doc="etcd: the state expires this many seconds after the last write or heartbeat"),
    Option("protocol", "choice", "http", _OUR_ETCD, ("etcd", "etcd-v2"),
           choices=("http", "https"), protects=frozenset({"https"}), doc=_TLS_DOC),
    Option("cacert", "file", None, _OUR_ETCD, ("etcd",), protects=True, doc=_TLS_DOC),
    Option("cert", "file", None, _OUR_ETCD, ("etcd",), protects=True, doc=_TLS_DOC),
    Option("key", "file", None, _OUR_ETCD, ("etcd",), protects=True, doc=_TLS_DOC),
    Option("user", "text", None, frozenset({_ETCD}), protects=True, doc="etcd authentication"),
    Option("password", "text", None, frozenset({_ETCD}), protects=True,
           doc="etcd authentication"),
    Option("password_file", "file", None, frozenset({_ETCD}), protects=True,
           doc="etcd authentication"),
    Option("member", "text", None, frozenset({_EMBEDDED}), doc_default="inferred",
           doc="etcd-embedded: which member of `--rdzv-endpoint` this node runs: its index "
           "(0-based), its `HOST:PORT`, or `none` (this node only uses the cluster). `HOST` may "
           "be a host name (compared as written). Unset: the member whose host is `local_addr`, "
           "else the one whose host is an address of this machine, else none; several on this "
           "machine (a test on 127.0.0.1) need it. See [Embedded etcd]"
           "(#embedded-etcd-no-single-point-of-failure-and-no-external-service)"),
    Option("data_dir", "text", None, frozenset({_EMBEDDED}),
           doc_default="the temporary directory",
           doc="etcd-embedded: where the member's private data directory "
           "(`rallypoint-etcd-<run id>-<member>`, mode 0700) is made; removed when the member "
           "stops, and emptied when a member starts (a replacement never reuses its "
           "predecessor's data)"),
    # --- torch's etcd-v2 names for the TLS files, read by rallypoint's etcd backends too
    Option("ca_cert", "file", None, _OUR_ETCD, ("etcd-v2",), protects=True, alias_of="cacert"),
    Option("ssl_cert", "file", None, _OUR_ETCD, ("etcd-v2",), protects=True, alias_of="cert"),
    Option("ssl_cert_key", "file", None, _OUR_ETCD, ("etcd-v2",), protects=True,
           alias_of="key"),
    # --- keys only torch's handlers read
    Option("etcd_prefix", "torch", torch=("etcd",),
           ignored="torch's etcd-v1 rendezvous keeps its keys under it; rallypoint's etcd "
           "backend keeps them under /rallypoint/<run id>/"),
    Option("timeout", "torch", torch=("etcd", "static"),
           ignored="torch's etcd-v1 rendezvous reads it as the join timeout, its static one as "
           "the store's timeout; the join timeout is join_timeout", torchrun_adds=True),
    Option("rank", "torch", torch=("static",), flag="--node-rank", flag_refuses=False,
           ignored="torch's static rendezvous reads it; the node rank is --node-rank"),
)  # fmt: skip

_BY_NAME: dict[str, Option] = {o.name: o for o in TABLE}


def option(name: str) -> Option:
    """The option ``name`` (KeyError: no backend reads it)."""
    return _BY_NAME[name]


# --- one coercion per type -----------------------------------------------------------------

_TRUE = frozenset({"1", "true", "t", "yes", "y", "on"})
_FALSE = frozenset({"0", "false", "f", "no", "n", "off"})


def _flag(value: object, opt: Option, where: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ConfigError(f"{where} {opt.name}={value!r} is not a boolean (use true or false)")


def _seconds(value: object, opt: Option, where: str) -> float:
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"{where} {opt.name}={value!r} is not a number of seconds") from None
    return check_seconds(seconds, f"{where} {opt.name}")


def _count(value: object, opt: Option, where: str) -> int:
    try:
        return int(str(value))
    except ValueError:
        raise ConfigError(f"{where} {opt.name}={value!r} is not an integer") from None


def _budget(value: object, opt: Option, where: str) -> int | None:
    """A job-wide restart budget: an integer, or none/empty for no shared budget."""
    if str(value).strip().lower() in ("", "none"):
        return None
    return _count(value, opt, where)


def _choice(value: object, opt: Option, where: str) -> str:
    text = str(value).strip().lower()
    if text not in opt.choices:
        raise ConfigError(f"{where} {opt.name}={value!r}: use {' or '.join(opt.choices)}")
    return text


def _file(value: object, opt: Option, where: str) -> str:
    path = os.path.expanduser(str(value).strip())
    if not path or not os.path.isfile(path) or not os.access(path, os.R_OK):
        raise ConfigError(
            f"{where} {opt.name}={value!r}: not a readable file (a PEM file on every node)"
        )
    return path


def _text(value: object, opt: Option, where: str) -> str:
    return str(value)


#: Each type -> how a given value (a string from ``--rdzv-conf``, or a typed value
#: from the Python API, as torch accepts both) is read; a bad one is a
#: :class:`ConfigError` naming the key and what is accepted.
COERCE: dict[str, Callable[[object, Option, str], Any]] = {
    "flag": _flag,
    "seconds": _seconds,
    "count": _count,
    "budget": _budget,
    "choice": _choice,
    "file": _file,
    "text": _text,
}


def coerce(name: str, config: Mapping[str, object], where: str = WHERE) -> Any:
    """The value of option ``name`` in ``config``: the given one read by its type's
    coercion, else the option's default (never :data:`SETTING`: use
    :func:`settings_values` for the settings).

    Raises:
        ConfigError: the value is not of the option's type or range.
    """
    opt = _BY_NAME[name]
    value = config.get(name)
    if value is None:
        return opt.default
    return COERCE[opt.type](value, opt, where)


def settings_values(config: Mapping[str, object]) -> dict[str, Any]:
    """The core ``Settings`` fields the options set: each given value read by its
    type, else the field's default.

    Raises:
        ConfigError: a value not of the option's type.
    """
    # Loaded here: the launcher's checks, and the workers importing rallypoint.agent,
    # need none of the core.
    from ..core import Settings

    defaults = {f.name: f.default for f in dataclasses.fields(Settings)}
    values = {}
    for opt in TABLE:
        if opt.setting:
            given = config.get(opt.name)
            values[opt.name] = (
                defaults[opt.name] if given is None else COERCE[opt.type](given, opt, WHERE)
            )
    return values


# --- who reads which key, and what another backend does with it -------------------------

#: The keys each of rallypoint's readers reads (``c10d``, ``etcd``,
#: ``etcd-embedded``): any other key is ignored with a warning or refused.
OPTIONS: dict[str, frozenset[str]] = {
    reader: frozenset(o.name for o in TABLE if reader in o.ours)
    for reader in (_C10D, _ETCD, _EMBEDDED)
}

#: Every rendezvous option torch 2.13's handlers read -> the torch backends that
#: read it (``c10d`` and ``etcd-v2``: its dynamic rendezvous; ``etcd``: its etcd-v1
#: rendezvous; ``static``). A test reads the keys from torch's own source.
TORCH_OPTIONS: dict[str, tuple[str, ...]] = {o.name: o.torch for o in TABLE if o.torch}


def torch_options(backend: str) -> frozenset[str]:
    """The rendezvous options torch's ``backend`` handler (``c10d``, ``etcd``,
    ``etcd-v2``, ``static``) reads."""
    return frozenset(o.name for o in TABLE if backend in o.torch)


def ignored_meaning(name: str) -> str:
    """What the warning about ``name`` ignored by a backend says."""
    opt = _BY_NAME[name]
    if opt.ignored:
        return opt.ignored
    readers = []
    if opt.torch:
        readers.append(f"torch's {'/'.join(opt.torch)}")
    if opt.ours:
        readers.append(f"rallypoint's {'/'.join(sorted(opt.ours))}")
    return f"read by {' and '.join(readers)} backends"


def check_options(
    config: Mapping[str, object], read: Collection[str], backend: str, option: str = WHERE
) -> dict[str, str]:
    """Sort the options ``config`` against what ``backend`` reads.

    A key in ``read`` is the backend's. A key another backend reads (one of
    :data:`TABLE`) is accepted, as torchrun accepts it, and gets a warning:
    torchrun hands every key to every backend, and job scripts carry keys of the
    backend they were written for. Two kinds of key are refused: one no backend
    reads (a misspelling), and one that asks for a protected connection
    (``protocol=https``, TLS files, etcd credentials: :attr:`Option.protects`)
    where ``backend`` does not read it, since the job would run unprotected while
    its user believes otherwise (torch ignores them).

    Returns:
        {key: the one-line warning for it}, for each accepted key ``backend``
        does not read (it must then be ignored).

    Raises:
        ConfigError: a key no backend reads, naming the closest known key; a
            protection ``backend`` cannot give, naming the backends that read it.
    """
    notes: dict[str, str] = {}
    for key, value in sorted(config.items()):
        if key in read:
            continue
        opt = _BY_NAME.get(key)
        if opt is None:
            close = difflib.get_close_matches(key, _BY_NAME, n=1)
            did_you_mean = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"{option} {key!r} is unknown to the {backend} backend; "
                f"{did_you_mean}known options: {', '.join(sorted(read))}"
            )
        if opt.asks_for_protection(value):
            raise ConfigError(
                f"{option} {key}: the {backend} backend does not read it, so its connection "
                f"would not be protected as asked ({ignored_meaning(key)})"
            )
        notes[key] = f"{option} {key} is ignored by the {backend} backend ({ignored_meaning(key)})"
    return notes


# --- the docs ------------------------------------------------------------------------------


#: The header of the docs' table (the rendered table's first line).
_DOCS_HEADER = "| key | default | meaning |"


def _shown_default(opt: Option, settings_defaults: Mapping[str, Any]) -> str:
    if opt.doc_default:
        return opt.doc_default
    value = settings_defaults[opt.name] if opt.default is SETTING else opt.default
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f"`{value}`"
    return f"{value:g}"


def render_docs_table() -> str:
    """docs/adapters.md's table of rallypoint's options (key, default, meaning),
    rendered from :data:`TABLE`: consecutive keys with the same meaning share a row."""
    from ..core import Settings

    settings_defaults = {f.name: f.default for f in dataclasses.fields(Settings)}
    rows: list[tuple[list[str], list[str], str]] = []
    for opt in TABLE:
        if not opt.ours or opt.alias_of:
            continue
        shown = _shown_default(opt, settings_defaults)
        if rows and rows[-1][2] == opt.doc:
            rows[-1][0].append(opt.name)
            rows[-1][1].append(shown)
        else:
            rows.append(([opt.name], [shown], opt.doc))
    lines = [_DOCS_HEADER, "| --- | --- | --- |"]
    for names, defaults, doc in rows:
        keys = ", ".join(f"`{name}`" for name in names)
        shown = defaults[0] if len(set(defaults)) == 1 else ", ".join(defaults)
        lines.append(f"| {keys} | {shown} | {doc} |")
    return "\n".join(lines) + "\n"


def replace_table(markdown: str, table: str) -> str:
    """``markdown`` with the table whose header is ``table``'s replaced by ``table``
    (a rendered docs table: ``RALLYPOINT_UPDATE_DOCS=1 pytest
    tests/adapters/test_options.py`` rewrites the docs).

    Raises:
        ValueError: ``markdown`` has no such table.
    """
    header = table.splitlines()[0]
    lines = markdown.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip("\n") == header), None)
    if start is None:
        raise ValueError(f"no table of options (a line {header!r}) in the text")
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "".join(lines[:start]) + table + "".join(lines[end:])
