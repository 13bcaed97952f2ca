"""A rendezvous's configuration: the one home of every check on it, and the parser of
torch's ``RendezvousParameters``.

Two paths reach a rendezvous: ``rallypoint run`` (:mod:`rallypoint.agent.config`
checks its flags) and torchrun or the Python API (:func:`parse_params` checks
torch's parameters). Both call the checks here: one table of backend names
(:data:`BACKEND_KINDS`), one endpoint parser (:func:`parse_endpoint`,
:func:`parse_endpoints`, :func:`split_scheme`), one run-id, host and duration
check, and one error type (:class:`ConfigError`). The messages differ only in how
they name the option: ``--rdzv-endpoint`` for the launcher, "rendezvous endpoint"
for the parameters. Nothing here imports torch.

The rendezvous options (``--rdzv-conf`` keys) are described once, in the typed
table of :mod:`rallypoint.adapters.options`: their types and coercions (values
arrive as strings, ``"true"``, ``"5"``, or typed values; both are accepted, as in
torch), their defaults (the settings': the core's :class:`~rallypoint.core.Settings`),
and the rule that sorts them, :func:`check_options`: a key the backend reads is
used; a key that some other backend reads (torch 2.13's, :data:`TORCH_OPTIONS`, or
rallypoint's, :data:`OPTIONS`) is accepted with a one-line warning that it is
ignored here, since torchrun hands every key to every backend and its handlers
skip what they do not read; any other key is an error naming the closest known
one (a misspelt ``join_timout=5`` would silently leave the join timeout at 600 s),
and so is a TLS or credential option the backend would ignore (the connection
would not be protected as asked). This module exports those names as before.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
import tempfile
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import options as _options
from .options import (
    MAX_SECONDS,
    OPTIONS,
    TORCH_OPTIONS,
    ConfigError,
    check_options,
    check_seconds,
    coerce,
    settings_values,
    torch_options,
)

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from ..core import Settings

__all__ = [
    "BACKEND_KINDS",
    "DEFAULT_PORT_BY_KIND",
    "EMBEDDED_BACKENDS",
    "ETCD_BACKENDS",
    "MAX_RUN_ID_LENGTH",
    "MAX_SECONDS",
    "OPTIONS",
    "TORCH_OPTIONS",
    "ConfigError",
    "EmbeddedEtcd",
    "EtcdAuth",
    "EtcdTLS",
    "RendezvousConfig",
    "RendezvousConfigError",
    "backend_options",
    "check_backend",
    "check_host",
    "check_local_addr",
    "check_options",
    "check_protocol",
    "check_resolves",
    "check_run_id",
    "check_seconds",
    "format_endpoint",
    "parse_backend_endpoint",
    "parse_endpoint",
    "parse_endpoints",
    "parse_params",
    "split_scheme",
    "torch_options",
]

log = logging.getLogger(__name__)

#: rallypoint's backends: each name ``params.backend`` (or ``--rdzv-backend``) may
#: give -> the kind of store behind it. The plain names and the torchrun entry points.
BACKEND_KINDS: dict[str, str] = {
    "c10d": "c10d",
    "rallypoint-c10d": "c10d",
    "etcd": "etcd",
    "rallypoint-etcd": "etcd",
    # The etcd backend on etcd members the agents of the first nodes run themselves
    # (adapters/etcd/embedded.py): kind "etcd", so the launcher checks its member
    # list as any etcd endpoint list.
    "etcd-embedded": "etcd",
    "rallypoint-etcd-embedded": "etcd",
}

#: The backends whose etcd members the agents run themselves (docs/adapters.md,
#: "Embedded etcd"): ``--rdzv-endpoint`` lists every member's ``host:client_port``.
EMBEDDED_BACKENDS = frozenset({"etcd-embedded", "rallypoint-etcd-embedded"})

#: The port of an endpoint that names only a host, per kind (torch's defaults).
DEFAULT_PORT_BY_KIND: dict[str, int] = {"c10d": 29400, "etcd": 2379}

#: rallypoint's etcd backends: their endpoint may list the members of one etcd
#: cluster (:func:`parse_endpoints`) and name TLS by a scheme (:func:`split_scheme`).
ETCD_BACKENDS = frozenset(name for name, kind in BACKEND_KINDS.items() if kind == "etcd")

#: Longest run id: it prefixes every store key, so a pasted blob would make every
#: key as large.
MAX_RUN_ID_LENGTH = 255

#: torch's etcd-v2 backend names for the TLS options -> the names used here.
_ETCD_ALIASES = {o.name: o.alias_of for o in _options.TABLE if o.alias_of}

#: Keys torch's launcher adds to every backend's parameters, whatever the user
#: wrote: under torchrun a warning about them would say nothing about the user's input.
_LAUNCHER_KEYS = frozenset(o.name for o in _options.TABLE if o.torchrun_adds)

# A DNS name or an IPv4 address: dot-separated labels of letters, digits, '-' and
# '_' (underscores appear in container and cluster host names).
_HOST_LABEL = re.compile(r"[A-Za-z0-9_-]{1,63}")
_PORT = re.compile(r"[0-9]{1,5}")

#: How messages name an endpoint given in torch's parameters (the launcher's
#: checks pass ``--rdzv-endpoint``).
_ENDPOINT = "rendezvous endpoint"


#: The adapters' name for :class:`ConfigError`: what :func:`parse_params` and
#: ``create_handler`` raise for invalid parameters.
RendezvousConfigError = ConfigError


# --- values of every kind ----------------------------------------------------------------


def check_backend(name: str, known: Collection[str], option: str = "rendezvous backend") -> None:
    """Refuse a backend ``name`` that is not in ``known``.

    Raises:
        ConfigError: naming ``option`` and every known name.
    """
    if name not in known:
        raise ConfigError(f"{option} {name!r} is unknown; use one of {', '.join(sorted(known))}")


def check_host(host: str, option: str) -> str:
    """Return ``host`` if it is a host name, an IPv4 or an IPv6 address.

    A malformed host (a space, a stray ``:``) would otherwise reach the resolver
    and the store client, which retry it for a minute before failing.

    Raises:
        ConfigError: naming ``option`` and the accepted forms.
    """
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(f"{option} {host!r}: not a valid IPv6 address") from None
        return host
    labels = host[:-1].split(".") if host.endswith(".") else host.split(".")
    if len(host) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        raise ConfigError(
            f"{option} {host!r}: expected a host name (letters, digits, '-', '_' "
            "between dots), an IPv4 address or an IPv6 address"
        )
    return host


def check_run_id(run_id: str, option: str = "rendezvous run id") -> None:
    """Refuse a run id that would break the store's key layout or the log directory.

    Keys live under ``rallypoint/<run_id>/``: a ``/`` in one run id can reach into
    another run's keys.

    Raises:
        ConfigError: the id is empty, too long, or has a ``/`` or a control character.
    """
    if not isinstance(run_id, str) or not run_id:
        raise ConfigError(f"{option} must not be empty")
    if len(run_id) > MAX_RUN_ID_LENGTH:
        raise ConfigError(
            f"{option} must be at most {MAX_RUN_ID_LENGTH} characters, got {len(run_id)}"
        )
    if "/" in run_id or not run_id.isprintable():
        raise ConfigError(f"{option} {run_id!r}: must not contain '/' or control characters")


# --- endpoints ---------------------------------------------------------------------------


def format_endpoint(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets (``[::1]:29400``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _split_host_port(text: str, endpoint: str, option: str) -> tuple[str, str]:
    """``host[:port]`` or ``[ipv6][:port]`` -> (host, port text; '' if none is given)."""
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep:
            raise ConfigError(f"{option} {endpoint!r}: missing ']' after the IPv6 host")
        if rest and not rest.startswith(":"):
            raise ConfigError(f"{option} {endpoint!r}: expected [IPv6]:PORT")
        return host, rest[1:]
    if text.count(":") > 1:
        raise ConfigError(
            f"{option} {endpoint!r}: expected HOST:PORT with one ':' "
            "(an IPv6 address goes in brackets, [::1]:29400)"
        )
    host, _, port_text = text.partition(":")
    return host, port_text


def parse_endpoint(
    endpoint: str, default_port: int | None, *, option: str = _ENDPOINT, backend: str | None = None
) -> tuple[str, int]:
    """``host[:port]`` (IPv6 in brackets) -> (host, port); an empty endpoint is
    ``localhost``, as in torch.

    The host is checked too: a malformed one (a space, a second ``:``) would
    otherwise be retried by the resolver and the store client for a minute.

    Args:
        default_port: the port of an endpoint without one (None: a port is required).
        option: how messages name the endpoint (``--rdzv-endpoint`` for the launcher).
        backend: the backend's name, for messages.

    Raises:
        ConfigError: a list of endpoints (only :func:`parse_endpoints` takes one),
            a malformed or missing host, a missing port where there is no default,
            or a port that is not a decimal integer in 0..65535.
    """
    who = "this backend" if backend is None else f"the {backend} backend"
    if "," in endpoint:
        raise ConfigError(
            f"{option} {endpoint!r}: {who} takes one HOST:PORT; a comma-separated list "
            "(the members of one etcd cluster) is accepted only by the etcd backends "
            f"({', '.join(sorted(ETCD_BACKENDS))})"
        )
    text = endpoint.strip()
    host, port_text = _split_host_port(text, endpoint, option) if text else ("localhost", "")
    if not host:
        raise ConfigError(f"{option} {endpoint!r}: missing host (expected host:port)")
    check_host(host, f"{option} {endpoint!r}: host")
    if not port_text:
        if default_port is None:
            raise ConfigError(f"{option} {endpoint!r}: {who} needs host:port")
        return host, default_port
    if not _PORT.fullmatch(port_text):
        raise ConfigError(f"{option} {endpoint!r}: port {port_text!r} is not a number")
    port = int(port_text)
    if port > 65535:
        raise ConfigError(f"{option} {endpoint!r}: port {port} is out of range 0..65535")
    return host, port


def parse_endpoints(
    endpoints: str, default_port: int | None, *, option: str = _ENDPOINT
) -> list[tuple[str, int]]:
    """``host[:port][,host[:port]...]`` (the members of one etcd cluster) ->
    [(host, port), ...], in the order given (the order of failover); each member
    as :func:`parse_endpoint` reads it.

    Raises:
        ConfigError: an empty item (``a:1,,b:2``), an item that
            :func:`parse_endpoint` refuses, or the same member twice.
    """
    items = [item.strip() for item in endpoints.split(",")]
    if len(items) > 1 and not all(items):
        raise ConfigError(
            f"{option} {endpoints!r}: an empty entry in the list; give "
            "HOST:PORT,HOST:PORT,... (the members of one etcd cluster)"
        )
    members = [parse_endpoint(item, default_port, option=option) for item in items]
    repeated = sorted({format_endpoint(*m) for m in members if members.count(m) > 1})
    if repeated:
        raise ConfigError(
            f"{option} {endpoints!r}: a member is named twice ({', '.join(repeated)}); "
            "give each etcd member once"
        )
    return members


def parse_backend_endpoint(
    endpoint: str, backend: str, default_port: int | None, *, option: str = _ENDPOINT
) -> list[tuple[str, int]]:
    """The store endpoint of ``backend`` -> its members [(host, port), ...]: the
    members of one etcd cluster for rallypoint's etcd backends (:data:`ETCD_BACKENDS`,
    :func:`parse_endpoints`), one endpoint for every other (:func:`parse_endpoint`).
    The one endpoint parser of the launcher (``--rdzv-endpoint``) and the handler.

    Raises:
        ConfigError: as :func:`parse_endpoints` or :func:`parse_endpoint`.
    """
    if backend in ETCD_BACKENDS:
        return parse_endpoints(endpoint, default_port, option=option)
    return [parse_endpoint(endpoint, default_port, option=option, backend=backend)]


def split_scheme(endpoint: str, option: str = _ENDPOINT) -> tuple[str | None, str]:
    """``https://host:port`` -> ("https", "host:port"); no scheme -> (None, endpoint).

    The scheme is how torch's etcd users ask for TLS. A list
    (``https://a:2379,https://b:2379``) loses each member's scheme; the members
    that name one must name the same.

    Raises:
        ConfigError: a scheme other than http and https, or both in one list.
    """
    if "://" not in endpoint:
        return None, endpoint
    schemes: set[str] = set()
    members: list[str] = []
    for item in endpoint.split(","):
        scheme, sep, address = item.strip().partition("://")
        if not sep:
            members.append(item.strip())
            continue
        scheme = scheme.lower()
        if scheme not in ("http", "https"):
            raise ConfigError(f"{option} {endpoint!r}: the scheme must be http:// or https://")
        schemes.add(scheme)
        members.append(address.removesuffix("/"))
    if len(schemes) > 1:
        raise ConfigError(
            f"{option} {endpoint!r} mixes http:// and https://; the members of one etcd "
            "cluster are reached the same way"
        )
    return schemes.pop(), ",".join(members)


def check_protocol(
    given: object,
    scheme: str | None,
    *,
    option: str = "rendezvous option",
    endpoint_option: str = "the rendezvous endpoint",
) -> str | None:
    """The etcd ``protocol`` option (``http`` or ``https``; None if not given),
    checked against the endpoint's ``scheme`` (:func:`split_scheme`).

    Raises:
        ConfigError: another protocol, or one the scheme contradicts.
    """
    if given is None:
        return None
    protocol: str = coerce("protocol", {"protocol": given}, option)
    if scheme is not None and scheme != protocol:
        raise ConfigError(
            f"{option} protocol={given} contradicts the {scheme}:// of {endpoint_option}; "
            "give one of them"
        )
    return protocol


def check_local_addr(addr: str) -> None:
    """``addr`` must name this host: each node serves its workers' store there, and a
    server on another host's address waited for itself until join_timeout.

    Raises:
        ConfigError: ``addr`` does not resolve, or no address it resolves to can
            be bound here.
    """
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ConfigError(
            f"local address {addr!r} does not resolve ({exc.strerror or exc}); give an "
            "address or host name of this host"
        ) from None
    addresses = list(dict.fromkeys((info[0], str(info[4][0])) for info in infos))
    for family, address in addresses:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address, 0))
            except OSError:
                continue
            return
    shown = ", ".join(address for _, address in addresses)
    raise ConfigError(
        f"local address {addr!r} ({shown}) is not an address of this host; give one of "
        "its addresses or host names (local_addr, --local-addr)"
    )


#: getaddrinfo's answers that say the name does not exist (not that the resolver
#: could not be asked).
_NO_SUCH_NAME = frozenset({socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)})


def check_resolves(hosts: Sequence[str], option: str) -> None:
    """Refuse ``hosts`` (one store, or the members of one etcd cluster) when the
    resolver says that none of them exists.

    A store client retries a name that does not resolve for its whole timeout
    (torch's static store: 600 s under ``rallypoint run``) before it fails. A name
    the resolver could not look up right now (no DNS server answered) passes: it
    may resolve in a moment. When some members of a list exist, the others are
    logged and left to failover (a member's record may be back when it is).

    Raises:
        ConfigError: the resolver answered that no host of ``hosts`` exists.
    """
    missing: list[str] = []
    for host in hosts:
        try:
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            if exc.errno in _NO_SUCH_NAME:
                missing.append(f"{option} {host!r} does not resolve ({exc.strerror or exc})")
        except (OSError, UnicodeError):
            pass
    if missing and len(missing) == len(hosts):
        raise ConfigError(f"{missing[0]}; give a host name or address every node can resolve")
    for line in missing:
        log.warning("%s; using the other members", line)


# --- torch's RendezvousParameters -------------------------------------------------------


@dataclass(frozen=True)
class EtcdTLS:
    """Files for an https connection to etcd (PEM paths, checked readable).

    ``cacert``: the CA that signed the server's certificate (None: the system's
    trusted CAs). ``cert`` and ``key``: this client's certificate and private key,
    for a server started with ``--client-cert-auth`` (both or neither).
    """

    cacert: str | None = None
    cert: str | None = None
    key: str | None = None


@dataclass(frozen=True)
class EtcdAuth:
    """etcd user name and password (a server with ``etcdctl auth enable``)."""

    user: str
    # Kept out of repr: configs end up in logs and error messages.
    password: str = field(repr=False)


@dataclass(frozen=True)
class EmbeddedEtcd:
    """The etcd members the agents run themselves (``etcd-embedded``).

    ``members``: every member's (host, client port) in the order of
    ``--rdzv-endpoint``; its peer port is the client port + 1 (etcd's 2379/2380).
    ``own``: the index of the member this node runs, or None (a node that only
    uses the cluster). ``data_dir``: where each member's private data directory
    is made (``rallypoint-etcd-<run id>-<member>``).
    """

    members: tuple[tuple[str, int], ...]
    own: int | None
    data_dir: str


@dataclass(frozen=True)
class RendezvousConfig:
    """Everything :func:`rallypoint.adapters.create_handler` reads from the parameters."""

    kind: str
    backend_name: str
    endpoint: str
    settings: Settings
    local_addr: str
    is_host: bool | None
    store_type: str
    read_timeout: float
    etcd_ttl: float | None
    etcd_tls: EtcdTLS | None = None
    etcd_auth: EtcdAuth | None = None
    embedded: EmbeddedEtcd | None = None


def backend_options(backend: str) -> frozenset[str]:
    """The ``--rdzv-conf`` keys rallypoint's ``backend`` (a name of
    :data:`BACKEND_KINDS`) reads."""
    return OPTIONS["etcd-embedded" if backend in EMBEDDED_BACKENDS else BACKEND_KINDS[backend]]


def _settings(params: RendezvousParameters) -> Settings:
    """The core's settings: each option given, else the field's default."""
    from ..core import Settings  # loaded here: the launcher's checks need none of the core

    values = settings_values(params.config)
    try:
        return Settings(
            run_id=params.run_id, min_nodes=params.min_nodes, max_nodes=params.max_nodes, **values
        )
    except ValueError as exc:  # Settings' own range checks
        raise ConfigError(f"rendezvous settings: {exc}") from None


def _local_addr(params: RendezvousParameters) -> str:
    given = params.config.get("local_addr") or params.local_addr
    if given:
        check_local_addr(str(given))
    return str(given or socket.getfqdn())


def _etcd_tls(conf: Mapping[str, object], scheme: str | None) -> EtcdTLS | None:
    files = {name: conf.get(name) for name in ("cacert", "cert", "key")}
    given = sorted(name for name, value in files.items() if value is not None)
    # Certificates without a protocol mean https: torch would send them nowhere
    # (plain http) and the user would believe the connection is protected.
    protocol = check_protocol(conf.get("protocol"), scheme) or scheme
    protocol = protocol or ("https" if given else "http")
    if protocol == "http":
        if given:
            raise ConfigError(
                f"rendezvous options {', '.join(given)} need protocol=https "
                "(or an https:// endpoint); with http they would not be used"
            )
        return None
    if (files["cert"] is None) != (files["key"] is None):
        raise ConfigError(
            "rendezvous options cert and key go together: the client certificate and "
            "its private key (PEM files)"
        )
    paths = {name: None if value is None else coerce(name, conf) for name, value in files.items()}
    return EtcdTLS(cacert=paths["cacert"], cert=paths["cert"], key=paths["key"])


def _etcd_auth(conf: Mapping[str, object]) -> EtcdAuth | None:
    user, password, password_file = (
        conf.get("user"),
        conf.get("password"),
        conf.get("password_file"),
    )
    if password is not None and password_file is not None:
        raise ConfigError("rendezvous options password and password_file: give one of them")
    if password_file is not None:
        path = coerce("password_file", conf)
        try:
            with open(path, encoding="utf-8") as file:
                password = file.read().rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(
                f"rendezvous option password_file={password_file!r}: cannot read it ({exc})"
            ) from None
    if user is None and password is None:
        return None
    if not user or password is None:
        raise ConfigError(
            "rendezvous options user and password (or password_file) go together: "
            "the etcd user and its password"
        )
    return EtcdAuth(user=str(user), password=str(password))


def _etcd_conf(config: Mapping[str, object]) -> dict[str, object]:
    """``config`` with torch's etcd-v2 aliases renamed; an option given twice under
    two names must agree."""
    conf = dict(config)
    for alias, name in _ETCD_ALIASES.items():
        if alias not in conf:
            continue
        value = conf.pop(alias)
        if name in conf and str(conf[name]) != str(value):
            raise ConfigError(
                f"rendezvous options {name} and {alias} name the same file but differ; "
                "give one of them"
            )
        conf[name] = value
    return conf


def _etcd_access(
    params: RendezvousParameters,
) -> tuple[str, list[tuple[str, int]], EtcdTLS | None, EtcdAuth | None]:
    """The member list (without scheme), its members, TLS and authentication of an
    etcd backend; a malformed list, or one whose members' names all do not exist,
    fails here, before anything starts."""
    scheme, endpoint = split_scheme(params.endpoint)
    members = parse_backend_endpoint(endpoint, params.backend, DEFAULT_PORT_BY_KIND["etcd"])
    conf = _etcd_conf(params.config)
    tls, auth = _etcd_tls(conf, scheme), _etcd_auth(conf)
    check_resolves([host for host, _ in members], f"{_ENDPOINT} host")
    return endpoint, members, tls, auth


def _check_options(params: RendezvousParameters) -> None:
    notes = check_options(params.config, backend_options(params.backend), params.backend)
    for key, note in notes.items():
        # torch's launcher adds these whether or not the user wrote them.
        log.log(logging.DEBUG if key in _LAUNCHER_KEYS else logging.WARNING, "%s", note)


def parse_params(params: RendezvousParameters) -> RendezvousConfig:
    """Validate ``params`` and turn them into a :class:`RendezvousConfig`.

    Raises:
        ConfigError: an unknown backend name (the message lists the accepted
            ones), an option no backend reads (the message suggests the closest
            known one), an option of the wrong type or range, a run id with '/',
            a local address that is not this host's, a malformed endpoint or
            etcd endpoint list, an endpoint host the resolver says does not
            exist (etcd: every member's), or (etcd) contradicting or incomplete
            TLS and authentication options or an unreadable file.

    An option another backend reads is logged as ignored (:func:`check_options`).
    """
    check_backend(params.backend, BACKEND_KINDS)
    kind = BACKEND_KINDS[params.backend]
    embedded_mode = params.backend in EMBEDDED_BACKENDS
    _check_options(params)
    check_run_id(params.run_id)
    settings = _settings(params)
    local_addr = _local_addr(params)
    store_type = coerce("store_type", params.config)
    members: list[tuple[str, int]] = []
    endpoint, tls, auth = params.endpoint, None, None
    if kind == "etcd":
        endpoint, members, tls, auth = _etcd_access(params)
    elif store_type == "tcp":
        members = parse_backend_endpoint(endpoint, params.backend, DEFAULT_PORT_BY_KIND["c10d"])
        check_resolves([host for host, _ in members], f"{_ENDPOINT} host")
    embedded = _embedded(params, endpoint, members, local_addr) if embedded_mode else None
    return RendezvousConfig(
        kind=kind,
        backend_name=params.backend,
        endpoint=endpoint,
        settings=settings,
        local_addr=local_addr,
        is_host=coerce("is_host", params.config),
        store_type=store_type,
        read_timeout=coerce("read_timeout", params.config),
        etcd_ttl=coerce("ttl", params.config),
        etcd_tls=tls,
        etcd_auth=auth,
        embedded=embedded,
    )


def _host_is_here(host: str) -> bool:
    """Whether ``host`` names an address this host can listen on."""
    try:
        check_local_addr(host)
    except ConfigError:
        return False
    return True


def _embedded(
    params: RendezvousParameters,
    endpoint: str,
    listed: Sequence[tuple[str, int]],
    local_addr: str,
) -> EmbeddedEtcd:
    """The members of an embedded etcd and which of them this node runs.

    Without ``member``, this node runs the member whose host is ``local_addr``,
    else the one whose host is an address of this host; none: it only uses the
    cluster. Several candidates (members on one host differ by port) need
    ``member``.

    Raises:
        ConfigError: ``member`` names no member of the list, or it is needed.
    """
    members = tuple(listed)
    names = [format_endpoint(*m) for m in members]
    taken = {(host, port + 1) for host, port in members}
    for name, (host, port) in zip(names, members, strict=True):
        if port >= 65535 or port == 0 or (host, port) in taken:
            raise ConfigError(
                f"rendezvous endpoint {endpoint!r}: member {name} serves clients on port "
                f"{port} and its peers on port {port + 1}; give each member a client port "
                "whose next port is free too (the default 2379 uses 2380)"
            )
    given = params.config.get("member")
    own: int | None
    if given is not None:
        text = str(given).strip()
        if text.lower() == "none":
            own = None
        elif text.isdigit() and int(text) < len(members):
            own = int(text)
        elif text in names:
            own = names.index(text)
        else:
            raise ConfigError(
                f"rendezvous option member={given!r}: give the index (0..{len(members) - 1}) "
                f"or the HOST:PORT of one of the members {', '.join(names)}, or none"
            )
    else:
        candidates = [i for i, (host, _) in enumerate(members) if host == local_addr]
        if not candidates:
            candidates = [i for i, (host, _) in enumerate(members) if _host_is_here(host)]
        if len(candidates) > 1:
            raise ConfigError(
                f"members {', '.join(names[i] for i in candidates)} are all on this host: "
                "say which one this node runs with the rendezvous option member=INDEX "
                "(or member=none)"
            )
        own = candidates[0] if candidates else None
    data_dir = os.path.expanduser(str(params.config.get("data_dir") or "")) or tempfile.gettempdir()
    return EmbeddedEtcd(members=members, own=own, data_dir=data_dir)


#: Names this module had before 0.2.0 (CHANGELOG.md): each still works, with a
#: warning naming the new one, until the next release.
_MOVED = {
    "BACKENDS": f"{__name__}:BACKEND_KINDS",
    "DEFAULT_PORTS": f"{__name__}:DEFAULT_PORT_BY_KIND",
}


def __getattr__(name: str) -> Any:
    # Imported here: this module is read before anything else loads (the
    # launcher checks its flags with it), and only an old name needs the core.
    from ..core.deprecation import moved_names

    return moved_names(__name__, _MOVED)(name)
