"""Parse torch's ``RendezvousParameters`` into rallypoint settings and options.

``--rdzv-conf`` values arrive as strings (``"true"``, ``"5"``) or typed values;
both are accepted, as in torch. Defaults follow torch's c10d rendezvous.

Unlike torch's handlers, an option this handler does not read is an error naming
the closest known one: a misspelt ``join_timout=5`` silently left the join timeout
at 600 s. torch's handlers cannot do this because ``RendezvousParameters`` is one
bag shared by every backend and torch's launcher puts ``timeout`` in it for all of
them (``torch/distributed/launcher/api.py``); that key is accepted and ignored.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import os
import re
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from torch.distributed.elastic.rendezvous import RendezvousParameters

from ..core import Settings

__all__ = [
    "BACKENDS",
    "OPTIONS",
    "EtcdAuth",
    "EtcdTLS",
    "RendezvousConfig",
    "RendezvousConfigError",
    "check_local_addr",
    "parse_endpoint",
    "parse_endpoints",
    "parse_params",
]

#: Accepted ``params.backend`` names: the plain ones and the torchrun entry points.
BACKENDS: dict[str, str] = {
    "c10d": "c10d",
    "rallypoint-c10d": "c10d",
    "etcd": "etcd",
    "rallypoint-etcd": "etcd",
}

#: The options each kind of backend reads (``--rdzv-conf`` keys); any other key is
#: rejected, so a new option must be added here.
_COMMON_OPTIONS = frozenset(
    {
        "join_timeout",
        "last_call_timeout",
        "close_timeout",
        "heartbeat_timeout",
        "keep_alive_interval",
        "keep_alive_max_attempt",
        "stable_ranks",
        "local_addr",
        "read_timeout",
    }
)
OPTIONS: dict[str, frozenset[str]] = {
    "c10d": _COMMON_OPTIONS | {"is_host", "store_type"},
    "etcd": _COMMON_OPTIONS
    | {
        "ttl",
        # TLS: the names of torch's etcd rendezvous (etcd_rendezvous.py), and of its
        # etcd-v2 backend (ssl_cert, ssl_cert_key, ca_cert) as aliases.
        "protocol",
        "cacert",
        "cert",
        "key",
        "ca_cert",
        "ssl_cert",
        "ssl_cert_key",
        # etcd's own authentication (torch has none).
        "user",
        "password",
        "password_file",
    },
}

#: torch's etcd-v2 backend names for the TLS options -> the names used here.
_ETCD_ALIASES = {"ca_cert": "cacert", "ssl_cert": "cert", "ssl_cert_key": "key"}

#: Keys torch's launcher adds to every backend's parameters, whatever the user wrote.
_LAUNCHER_KEYS = frozenset({"timeout"})

#: Longest duration a seconds option takes (a week): the store clients' timeouts
#: overflow long before infinity.
_MAX_SECONDS = 7 * 24 * 3600.0

_TRUE = {"1", "true", "t", "yes", "y", "on"}
_FALSE = {"0", "false", "f", "no", "n", "off"}

_HOST_LABEL = re.compile(r"[A-Za-z0-9_-]{1,63}")
_PORT = re.compile(r"[0-9]{1,5}")


class RendezvousConfigError(ValueError):
    """A rendezvous parameter (endpoint, run id or option) is invalid; the message says
    which and what is accepted."""


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


def _bool(value: object, key: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise RendezvousConfigError(
        f"rendezvous option {key}={value!r} is not a boolean (use true or false)"
    )


def _seconds(value: object, key: str, default: float) -> float:
    if value is None:
        return default
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise RendezvousConfigError(
            f"rendezvous option {key}={value!r} is not a number of seconds"
        ) from None
    if not math.isfinite(seconds) or not 0 < seconds <= _MAX_SECONDS:
        raise RendezvousConfigError(
            f"rendezvous option {key}={value!r} must be more than 0 and at most "
            f"{_MAX_SECONDS:.0f} seconds"
        )
    return seconds


def _int(value: object, key: str, default: int) -> int:
    if value is None:
        return default
    try:
        number = int(str(value))
    except ValueError:
        raise RendezvousConfigError(
            f"rendezvous option {key}={value!r} is not an integer"
        ) from None
    return number


def _check_keys(keys: Iterable[object], kind: str, backend_name: str) -> None:
    known = OPTIONS[kind]
    for key in sorted(str(k) for k in keys):
        if key in known or key in _LAUNCHER_KEYS:
            continue
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise RendezvousConfigError(
            f"unknown rendezvous option {key!r} for the {backend_name} backend; "
            f"{hint}known options: {', '.join(sorted(known))}"
        )


def _check_host(host: str, endpoint: str) -> None:
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise RendezvousConfigError(
                f"rendezvous endpoint {endpoint!r}: {host!r} is not an IPv6 address"
            ) from None
        return
    labels = host[:-1].split(".") if host.endswith(".") else host.split(".")
    if len(host) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        raise RendezvousConfigError(
            f"rendezvous endpoint {endpoint!r}: the host must be a host name (letters, "
            "digits, '-', '_' between dots), an IPv4 address or an IPv6 address in brackets"
        )


def parse_endpoint(endpoint: str, default_port: int) -> tuple[str, int]:
    """``host[:port]`` (IPv6 in brackets) -> (host, port).

    The host is checked too: a malformed one (a space, a second ``:``) would
    otherwise be retried by the resolver and the store client for a minute.

    Raises:
        RendezvousConfigError: a malformed host, or a port that is not a decimal
            integer in 0..65535.
    """
    text = endpoint.strip()
    if not text:
        return "localhost", default_port
    if "," in text:
        raise RendezvousConfigError(
            f"rendezvous endpoint {endpoint!r}: one HOST:PORT expected here; a "
            "comma-separated list of endpoints is accepted only by the etcd backends "
            "(the members of one etcd cluster)"
        )
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise RendezvousConfigError(
                f"rendezvous endpoint {endpoint!r}: expected [IPv6] or [IPv6]:PORT"
            )
        port_text = rest[1:]
    elif text.count(":") > 1:
        raise RendezvousConfigError(
            f"rendezvous endpoint {endpoint!r}: expected HOST:PORT with one ':' "
            "(an IPv6 address goes in brackets, [::1]:29400)"
        )
    else:
        host, _, port_text = text.partition(":")
    _check_host(host, endpoint)
    if not port_text:
        return host, default_port
    if not _PORT.fullmatch(port_text) or int(port_text) > 65535:
        raise RendezvousConfigError(
            f"the port in rendezvous endpoint {endpoint!r} is not in 0..65535"
        )
    return host, int(port_text)


def parse_endpoints(endpoints: str, default_port: int) -> list[tuple[str, int]]:
    """``host[:port][,host[:port]...]`` (the members of one etcd cluster) ->
    [(host, port), ...], in the order given (the order of failover).

    Raises:
        RendezvousConfigError: an empty item (``a:1,,b:2``), an item that
            :func:`parse_endpoint` refuses, or the same member twice.
    """
    items = [item.strip() for item in endpoints.split(",")]
    if len(items) > 1 and not all(items):
        raise RendezvousConfigError(
            f"rendezvous endpoint list {endpoints!r}: an empty entry; give "
            "HOST:PORT,HOST:PORT,... (the members of one etcd cluster)"
        )
    members = [parse_endpoint(item, default_port) for item in items]
    repeated = sorted({f"{h}:{p}" for h, p in members if members.count((h, p)) > 1})
    if repeated:
        raise RendezvousConfigError(
            f"rendezvous endpoint list {endpoints!r} names {', '.join(repeated)} twice; "
            "give each etcd member once"
        )
    return members


def _check_run_id(run_id: str) -> None:
    # Keys live under rallypoint/<run_id>/: a '/' would reach into another run's keys.
    if not isinstance(run_id, str) or not run_id:
        raise RendezvousConfigError("the rendezvous run id must be a non-empty string")
    if "/" in run_id or not run_id.isprintable():
        raise RendezvousConfigError(
            f"rendezvous run id {run_id!r}: must not contain '/' or control characters"
        )


def check_local_addr(addr: str) -> None:
    """``addr`` must name this host: each node serves its workers' store there, and a
    server on another host's address waited for itself until join_timeout.

    Raises:
        RendezvousConfigError: ``addr`` does not resolve, or no address it resolves
            to can be bound here.
    """
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise RendezvousConfigError(
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
    raise RendezvousConfigError(
        f"local address {addr!r} ({shown}) is not an address of this host; give one of "
        "its addresses or host names (local_addr, --local-addr)"
    )


def _readable_file(value: object, key: str) -> str:
    path = os.path.expanduser(str(value).strip())
    if not path or not os.path.isfile(path) or not os.access(path, os.R_OK):
        raise RendezvousConfigError(
            f"rendezvous option {key}={value!r}: not a readable file (a PEM file on every node)"
        )
    return path


def _split_scheme(endpoint: str) -> tuple[str | None, str]:
    """``https://host:port`` -> ("https", "host:port"); no scheme -> (None, endpoint).

    A list (``https://a:2379,https://b:2379``) loses each member's scheme; the
    members that name one must name the same.
    """
    if "://" not in endpoint:
        return None, endpoint
    schemes: set[str] = set()
    rest: list[str] = []
    for item in endpoint.split(","):
        scheme, sep, address = item.strip().partition("://")
        if not sep:
            rest.append(item.strip())
            continue
        scheme = scheme.lower()
        if scheme not in ("http", "https"):
            raise RendezvousConfigError(
                f"rendezvous endpoint {endpoint!r}: the scheme must be http:// or https://"
            )
        schemes.add(scheme)
        rest.append(address.removesuffix("/"))
    if len(schemes) > 1:
        raise RendezvousConfigError(
            f"rendezvous endpoint {endpoint!r} mixes http:// and https://; the members "
            "of one etcd cluster are reached the same way"
        )
    return schemes.pop(), ",".join(rest)


def _etcd_tls(conf: Mapping[str, object], scheme: str | None) -> EtcdTLS | None:
    protocol = conf.get("protocol")
    if protocol is not None:
        protocol = str(protocol).strip().lower()
        if protocol not in ("http", "https"):
            raise RendezvousConfigError(
                f"rendezvous option protocol={conf.get('protocol')!r}: use http or https"
            )
        if scheme is not None and scheme != protocol:
            raise RendezvousConfigError(
                f"rendezvous option protocol={protocol} contradicts the endpoint's "
                f"{scheme}:// scheme; give one of them"
            )
    files = {name: conf.get(name) for name in ("cacert", "cert", "key")}
    given = sorted(name for name, value in files.items() if value is not None)
    # Certificates without a protocol mean https: torch would send them nowhere
    # (plain http) and the user would believe the connection is protected.
    protocol = protocol or scheme or ("https" if given else "http")
    if protocol == "http":
        if given:
            raise RendezvousConfigError(
                f"rendezvous options {', '.join(given)} need protocol=https "
                "(or an https:// endpoint); with http they would not be used"
            )
        return None
    if (files["cert"] is None) != (files["key"] is None):
        raise RendezvousConfigError(
            "rendezvous options cert and key go together: the client certificate and "
            "its private key (PEM files)"
        )
    paths = {
        name: None if value is None else _readable_file(value, name)
        for name, value in files.items()
    }
    return EtcdTLS(cacert=paths["cacert"], cert=paths["cert"], key=paths["key"])


def _etcd_auth(conf: Mapping[str, object]) -> EtcdAuth | None:
    user, password, password_file = (
        conf.get("user"),
        conf.get("password"),
        conf.get("password_file"),
    )
    if password is not None and password_file is not None:
        raise RendezvousConfigError(
            "rendezvous options password and password_file: give one of them"
        )
    if password_file is not None:
        path = _readable_file(password_file, "password_file")
        try:
            with open(path, encoding="utf-8") as file:
                password = file.read().rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as exc:
            raise RendezvousConfigError(
                f"rendezvous option password_file={password_file!r}: cannot read it ({exc})"
            ) from None
    if user is None and password is None:
        return None
    if not user or password is None:
        raise RendezvousConfigError(
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
            raise RendezvousConfigError(
                f"rendezvous options {name} and {alias} name the same file but differ; "
                "give one of them"
            )
        conf[name] = value
    return conf


def parse_params(params: RendezvousParameters) -> RendezvousConfig:
    """Validate ``params`` and turn them into a :class:`RendezvousConfig`.

    Raises:
        RendezvousConfigError: an unknown backend name (the message lists the
            accepted ones), an unknown option (the message suggests the closest
            known one), an option of the wrong type or range, a run id with '/',
            a local address that is not this host's, or (etcd) contradicting or
            incomplete TLS and authentication options or an unreadable file.
    """
    kind = BACKENDS.get(params.backend)
    if kind is None:
        raise RendezvousConfigError(
            f"unknown rendezvous backend {params.backend!r}; rallypoint accepts "
            f"{', '.join(sorted(BACKENDS))}"
        )
    _check_keys(params.config, kind, params.backend)
    _check_run_id(params.run_id)
    get = params.config.get
    try:
        settings = Settings(
            run_id=params.run_id,
            min_nodes=params.min_nodes,
            max_nodes=params.max_nodes,
            join_timeout=_seconds(get("join_timeout"), "join_timeout", 600.0),
            last_call_timeout=_seconds(get("last_call_timeout"), "last_call_timeout", 30.0),
            close_timeout=_seconds(get("close_timeout"), "close_timeout", 30.0),
            heartbeat_timeout=_seconds(get("heartbeat_timeout"), "heartbeat_timeout", 5.0),
            keep_alive_interval=_seconds(get("keep_alive_interval"), "keep_alive_interval", 5.0),
            keep_alive_max_attempt=_int(get("keep_alive_max_attempt"), "keep_alive_max_attempt", 3),
            stable_ranks=bool(_bool(get("stable_ranks"), "stable_ranks")),
        )
    except RendezvousConfigError:
        raise
    except ValueError as exc:  # Settings' own range checks
        raise RendezvousConfigError(f"rendezvous settings: {exc}") from None
    given_addr = get("local_addr") or params.local_addr
    if given_addr:
        check_local_addr(str(given_addr))
    local_addr = given_addr or socket.getfqdn()
    store_type = str(get("store_type", "tcp")).strip().lower()
    if store_type not in ("tcp", "file"):
        raise RendezvousConfigError(f"rendezvous option store_type={store_type!r}: use tcp or file")
    ttl = get("ttl")
    endpoint, tls, auth = params.endpoint, None, None
    if kind == "etcd":
        scheme, endpoint = _split_scheme(params.endpoint)
        parse_endpoints(endpoint, 2379)  # a malformed list fails here, before anything starts
        conf = _etcd_conf(params.config)
        tls, auth = _etcd_tls(conf, scheme), _etcd_auth(conf)
    return RendezvousConfig(
        kind=kind,
        backend_name=params.backend,
        endpoint=endpoint,
        settings=settings,
        local_addr=str(local_addr),
        is_host=_bool(get("is_host"), "is_host"),
        store_type=store_type,
        read_timeout=_seconds(get("read_timeout"), "read_timeout", 60.0),
        etcd_ttl=None if ttl is None else _seconds(ttl, "ttl", 1.0),
        etcd_tls=tls,
        etcd_auth=auth,
    )
