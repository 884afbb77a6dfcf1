"""The sidecar's configuration: a YAML file, environment variables and flags.

Every setting has one dotted key (nested in the file: ``evaluation: {idle_s: 5}``), one
environment variable and one command-line flag; later sources win: defaults < file <
environment < flags. The table :data:`OPTIONS` is the single source of all three names,
of the defaults and of the documentation (``durable-sessions-collector config-reference`` prints it, and
``collector/README.md`` holds a copy).

Invalid configuration stops start-up with :class:`ConfigError`, whose message names the
key and where the bad value came from: a variable or a flag after the message, the place
in the file (``FILE:LINE:COLUMN``, as compilers write theirs) before it, e.g.::

    evaluation.idle_s: expected a positive number, got 'soon' (from DURABLE_SESSIONS_IDLE_S)
    collector.yaml:4:3: evaluation.idle_s: expected a positive number, got 'soon'

A key given twice in one mapping of the file is an error too: YAML parsers keep the last
one, so a second ``evaluation:`` block would quietly drop the first one's settings. So is
a dotted key in the file, which beside a nested one would give a setting twice.

An example file::

    receivers:
      grpc: {endpoint: 127.0.0.1:4319}
      http: {endpoint: 127.0.0.1:4320}
    store: sqlite:////var/lib/durable-sessions/sessions.db
    evaluation: {idle_s: 30, key_window_s: 86400, strict: false}
    alerts:
      webhook: {url: https://alerts.example/hook, max_attempts: 8}
"""

from __future__ import annotations

import contextlib
import difflib
import ipaddress
import os
import reprlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit, urlunsplit

import yaml

from durable_sessions.seconds import MAX_SECONDS, SecondsError, positive_seconds, positive_seconds_from_text

ENV_PREFIX = "DURABLE_SESSIONS_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"
"""The configuration file, when ``--config`` is not given."""
MIB = 1024 * 1024
GIB = 1024 * MIB


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key and the source."""


# --- value parsers: (raw value, from a string source?) -> value, or raise ValueError ---------


_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxdict = 2, 4, 4
_SHOWN.maxstring, _SHOWN.maxlong, _SHOWN.maxother = 1000, 60, 200


def _shown(value: Any) -> str:
    """``value`` as an error quotes it: its ``repr``, with a long or deeply nested list or
    mapping cut short. A file's aliases nest one list in another many times over at no
    cost (``- &b [*a, *a, …]``), and the full ``repr`` of eight such levels did not end:
    start-up hung. An integer past ``int``'s text limit (4300 digits) is said so."""
    try:
        return _SHOWN.repr(value)
    except ValueError:
        return "an integer of more than 4300 digits"


def _endpoint(value: Any, _text: bool) -> str:
    """``host:port`` to listen on or connect to, an IPv6 address in brackets (``[::1]:4319``).

    Refused here, naming the key, rather than by the bind at start-up, which said "Name or
    service not known" or grpcio's bare "Failed to bind": a scheme (``http://host:port``,
    as OTLP exporters write theirs), an IPv6 address without brackets (``::1:4319``), a
    space, or a port of other than ASCII digits (``int`` reads ``４３２０``, grpcio does not)."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected host:port, got {_shown(value)}")
    host, sep, port = value.strip().rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected host:port with a port from 0 to 65535, got {_shown(value)}")
    problem = _host_problem(host)
    if problem:
        raise ValueError(f"expected host:port, {problem}, got {_shown(value)}")
    return value.strip()


def _host_problem(host: str) -> str | None:
    """Why ``host`` (of ``host:port``) cannot be listened on or connected to, or None."""
    if "/" in host:
        return "without a scheme or path (e.g. 127.0.0.1:4319)"
    if any(c.isspace() for c in host):
        return "without spaces"
    if not {"[", "]", ":"} & set(host):
        return None
    if host.startswith("[") and host.endswith("]"):
        with contextlib.suppress(ValueError):
            ipaddress.IPv6Address(host[1:-1])
            return None
    return "with an IPv6 address in brackets (e.g. [::1]:4319)"


def _positive_number(value: Any, _text: bool) -> float:
    """A duration above 0 (see :func:`_duration`)."""
    return _duration(value, zero=False)


def _non_negative_number(value: Any, _text: bool) -> float:
    """A duration of 0 or more: one that 0 turns off (see :func:`_duration`)."""
    return _duration(value, zero=True)


def _duration(value: Any, *, zero: bool) -> float:
    """Seconds, as the span processor and the CLI take them (:mod:`durable_sessions.seconds`:
    finite, at most :data:`MAX_SECONDS`, about 31 years), in this file's words.

    A string is read as a variable's is, from the file too: the file is read as YAML 1.1,
    whose floats need a dot and a signed exponent, so ``1e3`` and ``8.64e4`` arrive as
    strings, where YAML 1.2, JSON and the environment read numbers."""
    try:
        if isinstance(value, str):
            return positive_seconds_from_text(value, zero=zero)
        return positive_seconds(value, zero=zero)
    except SecondsError as error:
        if error.kind == "too-long":
            raise ValueError(_too_long(value)) from None
        expected = "a number of 0 or more" if zero else "a positive number"
        finite = " (not a finite number)" if error.kind == "not-finite" else ""
        raise ValueError(f"expected {expected}, got {_shown(value)}{finite}") from None


def _too_long(value: Any) -> str:
    return f"expected at most {MAX_SECONDS:.0f} seconds (about 31 years), got {_shown(value)}"


MAX_COUNT = 2**53
"""Largest count or size a setting may give: the largest integer a float, and so a
Prometheus gauge (``durable_sessions_decoding_bytes_limit``, ``…_http_connections_limit``),
holds exactly. A larger one (past 1e308) ended start-up in an ``OverflowError``."""


def _positive_int(value: Any, _text: bool) -> int:
    """A positive integer; a string of digits is one, from the file too (quoted there, as
    templating tools write values), as :func:`_number` reads a string."""
    if isinstance(value, bool):
        raise ValueError(f"expected a positive integer, got {_shown(value)}")
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        # ASCII digits only: isdigit() takes "²", on which int() raised its own message,
        # and int() reads other scripts' digits ("６４") as no other program would.
        value = int(value.strip())
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"expected a positive integer, got {_shown(value)}")
    if value > MAX_COUNT:
        raise ValueError(f"expected a positive integer of at most {MAX_COUNT} (2^53), got {_shown(value)}")
    return value


MAX_MESSAGE_BYTES = 2**31 - 1
"""Largest message protobuf parses and grpcio's receive limit takes (a C ``int``): a larger
``receivers.max_request_bytes`` made start-up fail with a bare ``OverflowError``."""


def _request_bytes(value: Any, text: bool) -> int:
    """A positive integer of at most :data:`MAX_MESSAGE_BYTES`."""
    number = _positive_int(value, text)
    if number > MAX_MESSAGE_BYTES:
        raise ValueError(
            f"expected a positive integer of at most {MAX_MESSAGE_BYTES} (2 GiB - 1, the largest "
            f"message protobuf and gRPC take), got {_shown(value)}"
        )
    return number


def _seconds_int(value: Any, text: bool) -> int:
    """A positive whole number of seconds, at most :data:`MAX_SECONDS`."""
    number = _positive_int(value, text)
    if number > MAX_SECONDS:
        raise ValueError(_too_long(value))
    return number


def _optional_positive_int(value: Any, text: bool) -> int | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
        return None
    return _positive_int(value, text)


def _boolean(value: Any, _text: bool) -> bool:
    """true or false; a string spells one as a variable does, from the file too (quoted
    there: ``strict: "false"``), and so does a 1 or 0 the file reads as a number
    (``strict: 1``, which ``DURABLE_SESSIONS_STRICT=1`` means)."""
    if isinstance(value, bool):
        return value
    if type(value) is int and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
    raise ValueError(f"expected true or false, got {_shown(value)}")


def _store_url(value: Any, _text: bool) -> str:
    """A SQLite path or a PostgreSQL URL, read without surrounding whitespace (a Kubernetes
    Secret, a YAML block scalar, ends it with a newline: ``sqlite:///x.db`` so ended
    opened a file named ``x.db`` and a line break). A PostgreSQL URL is refused with a
    control character in it: libpq reads a line break or a tab into the password, and
    quotes it so in its errors, where Python's URL parser (and so the log's redactor)
    drops it and sees another password."""
    if isinstance(value, str):
        value = value.strip()
    if isinstance(value, str) and value.startswith(("postgresql://", "postgres://")):
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
            raise ValueError(
                "the URL holds a control character (a line break, a tab): percent-encode it "
                f"(a line break is %0A), got {redact_store_url(value)!r}"
            )
        cut = _cut_store_url(value)
        if cut is not None and cut[1] is not None and "@" in cut[1]:
            # libpq ends the user info at the first '@' and reads the rest of the password
            # into the host, which its errors then quote: no secret here covers that tail.
            raise ValueError(
                "expected postgresql://USER@HOST:PORT/DB (percent-encode an @ in the user name or "
                f"password: %40), got {redact_store_url(value)!r}"
            )
        try:
            parts = urlsplit(value)
            parts.port  # noqa: B018 - raises ValueError for a port that is not a number
        except ValueError:
            raise ValueError(
                f"expected postgresql://USER@HOST:PORT/DB{_userinfo_hint(value)}, got {redact_store_url(value)!r}"
            ) from None
        schemas = [v for k, v in parse_qsl(parts.query, keep_blank_values=True) if k == "schema"]
        if schemas and not all(v.isidentifier() and v.isascii() and len(v) <= 63 for v in schemas):
            raise ValueError(f"schema must be a plain identifier (letters, digits, _), got {schemas[-1]!r}")
        return value
    if not isinstance(value, str) or not value.startswith("sqlite:///") or value == "sqlite:///":
        raise ValueError(
            "expected sqlite:///PATH (e.g. sqlite:////var/lib/durable-sessions/sessions.db) or "
            f"postgresql://USER@HOST:PORT/DB[?schema=NAME], got "
            f"{_shown(redact_store_url(value) if isinstance(value, str) else value)}"
        )
    return value


# Query parameters of a database URL that hold a secret (libpq: the password, the client
# key's passphrase).
_DSN_SECRET_PARAMS = frozenset({"password", "sslpassword"})


def _cut_store_url(url: str) -> tuple[str, str | None, str] | None:
    """``url`` cut as libpq cuts it: (``scheme://``, the user info or None, what follows
    it), or None without ``://``. Never raises.

    libpq reads the user info up to an ``@`` before the first ``/``, whatever comes
    between: a ``#`` or ``?`` there is part of the password, where ``urlsplit`` ends the
    authority, and so would show the rest of the password as a fragment or a query. Of
    several ``@``, the last is taken: more is hidden, never less."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return None
    slash = rest.find("/")
    at = rest.rfind("@", 0, len(rest) if slash < 0 else slash)
    if at < 0:
        return f"{scheme}://", None, rest
    return f"{scheme}://", rest[:at], rest[at + 1 :]


def _userinfo_hint(url: str) -> str:
    """What to change when ``url``'s user info holds a ``#`` or ``?`` (which Python's URL
    parser takes for the end of the authority), else nothing."""
    cut = _cut_store_url(url)
    if cut is None or cut[1] is None or not {"#", "?"} & set(cut[1]):
        return ""
    return " (percent-encode a # or ? in the user name or password: %23, %3F)"


def _store_password(userinfo: str | None) -> str | None:
    """The password of a store URL's user info (None without one)."""
    if userinfo is None or ":" not in userinfo:
        return None
    return userinfo.partition(":")[2]


def _store_query(rest: str) -> str:
    """The query of what follows a store URL's user info (the host on)."""
    return rest.partition("?")[2].partition("#")[0]


def redact_store_url(url: str) -> str:
    """``url`` with its passwords replaced by ``***``: the one of the authority
    (``user:PASSWORD@host``) and the ``?password=`` (``sslpassword``) query values.

    Any scheme (an unsupported one is quoted back in errors), and never raises: the URL is
    cut by hand, as libpq cuts it (:func:`_cut_store_url`), so that a malformed one is
    redacted too. The user, host, database and other parameters stay, so the message
    still says which store."""
    cut = _cut_store_url(url)
    if cut is None:
        return url
    head, userinfo, rest = cut
    if userinfo is not None:
        hidden = _store_password(userinfo) is not None
        head += f"{userinfo.partition(':')[0]}:{SECRET}@" if hidden else f"{userinfo}@"
    before, question, query = rest.partition("?")
    query, hash_, fragment = query.partition("#")
    pairs = []
    for pair in query.split("&"):
        name, equals, _ = pair.partition("=")
        pairs.append(f"{name}={SECRET}" if equals and unquote(name) in _DSN_SECRET_PARAMS else pair)
    return f"{head}{before}{question}{'&'.join(pairs)}{hash_}{fragment}"


def store_secrets(url: str) -> list[str]:
    """What no message about the store at ``url`` may show, whatever their length: the
    passwords of a PostgreSQL URL (in the authority, read as libpq reads it, or as
    ``?password=``) as written, percent-decoded and percent-encoded (the store hands query
    values to libpq encoded again), and the URL itself when it holds a password. libpq
    quotes in its errors the part of the URL it could not read: the password, or the
    whole URL.

    The log's redactor takes only those of at least :data:`MIN_SECRET_CHARS`
    (:meth:`Config.secrets`)."""
    cut = _cut_store_url(url)
    if cut is None or not url.startswith(("postgresql://", "postgres://")):
        return []
    _, userinfo, rest = cut
    password = _store_password(userinfo)
    found = [password, unquote(password)] if password else []
    for pair in _store_query(rest).split("&"):
        name, equals, value = pair.partition("=")
        if equals and value and unquote(name) in _DSN_SECRET_PARAMS:
            decoded = unquote(value.replace("+", " "))
            found += [value, decoded, quote(decoded, safe="")]
    if found:
        found.insert(0, url)
    return list(dict.fromkeys(form for secret in found for form in _as_quoted_if_short(secret)))


def _as_quoted_if_short(secret: str) -> list[str]:
    """``secret`` as messages may show it. One shorter than :data:`MIN_SECRET_CHARS` (a
    password ``a``, or ``postgres``) only where it stands as a value: quoted, as libpq
    quotes it, or between ``:`` and ``@``; as bare text it would blank out every word
    holding it."""
    if len(secret) >= MIN_SECRET_CHARS:
        return [secret]
    return [f'"{secret}"', f"'{secret}'", f":{secret}@"]


def _hide_store(value: Any) -> Any:
    return redact_store_url(str(value))


def _optional_url(value: Any, _text: bool) -> str | None:
    """An http(s) URL a webhook POST can be sent to; an error shows it as the log would
    (path and query values hidden: webhook services put their secret there)."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ValueError(f"expected an http(s) URL, got {type(value).__name__}")
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http(s) URL, got {redact_url(value, hide_path=True)!r}")
    unsendable = _unsendable(value)
    if unsendable:
        raise ValueError(
            f"the URL holds {unsendable}, which no request can carry (percent-encode it: "
            f"a space is %20), got {redact_url(value, hide_path=True)!r}"
        )
    return value


def _unsendable(url: str) -> str | None:
    """What in ``url`` http.client refuses to send, at every attempt: a space or control
    character (in the request line or the Host header), or a character that is not
    ASCII in the path or query (the request line is ASCII; a host name is sent IDNA-
    encoded). None when there is none. Surrounding whitespace does not count: urllib
    strips it."""
    text = url.strip()
    if any(ord(c) <= 0x20 or ord(c) == 0x7F for c in text):
        return "a space or control character"
    parts = urlsplit(text)
    if not (parts.path + parts.query).isascii():
        return "a character that is not ASCII in its path or query"
    return None


def _optional_file(value: Any, _text: bool) -> str | None:
    """A readable file, its path read without surrounding whitespace as every setting is
    (a ConfigMap's value ends in a line break); a blank one is empty."""
    if isinstance(value, str):
        value = value.strip()
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ValueError(f"expected a file path, got {_shown(value)}")
    if not os.path.isfile(value):
        # A directory (a Secret volume's mount point given for the file in it) is not missing.
        what = "a directory, not a file" if os.path.isdir(value) else "no such file"
        raise ValueError(f"{what}: {_shown(value)}")
    if not os.access(value, os.R_OK):
        raise ValueError(f"file is not readable: {_shown(value)}")
    return value


# RFC 6750 b64token: what an ``Authorization: Bearer`` header can carry unquoted.
_TOKEN_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~+/")
MIN_TOKEN_CHARS = 16


def check_token(token: str) -> str:
    """``token`` if it can be sent as a bearer token; the error never repeats the token."""
    if token.startswith("\ufeff"):  # no one sees it
        raise ValueError(
            "starts with a byte order mark (U+FEFF), which Windows editors write: save the file as UTF-8 "
            "without one (value not shown)"
        )
    body = token.rstrip("=")
    scheme, space, rest = token.partition(" ")
    if space and scheme.lower() == "bearer" and rest.strip():
        # An Authorization header's value, where the token alone is meant.
        raise ValueError("write the token alone, without 'Bearer ' (value not shown)")
    if not body or any(c not in _TOKEN_CHARS for c in body):
        raise ValueError(
            "expected a bearer token of letters, digits and -._~+/ (RFC 6750), "
            "with no spaces or quotes (value not shown)"
        )
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"expected a bearer token of at least {MIN_TOKEN_CHARS} characters (value not shown)"
        )
    return token


def _optional_token(value: Any, _text: bool) -> str | None:
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError("expected a string (value not shown)")
    if not isinstance(value, str):
        # A token of digits (valid, and taken from the variable) is read by YAML as a number,
        # without its leading zeros or as octal: it cannot be turned back into the token.
        raise ValueError("YAML read the token as a number: quote it in the file (value not shown)")
    return check_token(value.strip())


def read_token_file(path: str) -> str:
    """The bearer token in ``path`` (surrounding whitespace ignored), checked."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot read {path!r}: {getattr(error, 'strerror', None) or error}") from None
    return check_token(text.strip())


class EncryptedKeyError(ValueError):
    """A private key file is encrypted (passphrase-protected), which is not supported."""


def refuse_passphrase() -> str:
    """The ``password`` of :meth:`ssl.SSLContext.load_cert_chain`, called only for an
    encrypted key. Without one, OpenSSL asks for the passphrase on the terminal: start-up
    waits there under a TTY, fails with a bare "Invalid argument" without one, and grpcio
    cannot use the key anyway. Raises :class:`EncryptedKeyError`; the caller names the key."""
    raise EncryptedKeyError(
        "the private key is encrypted (passphrase-protected), which is not supported: "
        "decrypt it (openssl pkey -in KEY -out PLAIN_KEY) into a file only its user can read"
    )


SECRET = "***"
# The log's redactor replaces every occurrence of a registered secret in every line, so a
# short value (a tenant id, ``?v=1``) would blank out unrelated text. Shorter values are
# still never printed: every place that prints a URL or headers redacts them structurally.
MIN_SECRET_CHARS = 8


def redact_url(url: str, *, hide_path: bool = False) -> str:
    """``url`` without its secrets: the password (or user) and every query value; with
    ``hide_path``, its path too (``/***``), where webhook services put theirs
    (``https://hooks.example/services/T0/B0/Xy…``)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return SECRET
    netloc = parts.netloc
    if "@" in netloc:
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        netloc = f"{SECRET}@{host}" + (f":{port}" if port is not None else "")
    query = "&".join(
        f"{pair.split('=', 1)[0]}={SECRET}" if "=" in pair else SECRET
        for pair in parts.query.split("&")
        if pair
    )
    path = "/" + SECRET if hide_path and parts.path not in ("", "/") else parts.path
    return urlunsplit((parts.scheme, netloc, path, query, ""))


def url_secrets(url: str) -> list[str]:
    """Strings of a webhook ``url`` for the log's redactor: its path, password, user and
    query values (as written and percent-decoded) of at least :data:`MIN_SECRET_CHARS`,
    and the whole URL if it has any of them (else it shows where alerts go, and stays).

    Shorter parts are not registered (``?v=1`` would turn every ``1`` of every line into
    ``***``); they are hidden where the URL is printed, which is always through
    :func:`redact_url`."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return [url]
    candidates = [parts.path, unquote(parts.path), parts.password, parts.username]
    for pair in parts.query.split("&"):
        _, equals, value = pair.partition("=")
        if equals:
            candidates += [value, unquote(value.replace("+", " "))]
    found = [value for value in candidates if value and len(value) >= MIN_SECRET_CHARS]
    if redact_url(url, hide_path=True) != url:
        found.insert(0, url)
    return list(dict.fromkeys(found))


def _hide(value: Any) -> Any:
    return None if value is None else SECRET


def _hide_webhook_url(value: Any) -> Any:
    return None if value is None else redact_url(str(value), hide_path=True)


def _hide_headers(value: Any) -> Any:
    return None if value is None else {name: SECRET for name, _ in value}


def _log_level(value: Any, _text: bool) -> str:
    """A level name in any case, read without surrounding whitespace as every other
    setting is (a value from a ConfigMap or a file may end in a line break)."""
    if not isinstance(value, str) or value.strip().upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ValueError(f"expected one of debug, info, warning, error, got {_shown(value)}")
    return value.strip().upper()


# --- alerts.otlp: a gRPC endpoint, its TLS choice and its metadata --------------------


def _otlp_endpoint(value: Any, text: bool) -> str | None:
    """``host:port``, ``http://host:port`` or ``https://host:port`` (an OTLP/gRPC target)."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ValueError(f"expected host:port or http(s)://host:port, got {_shown(value)}")
    value = value.strip()
    if "://" in value:
        try:
            parts = urlsplit(value)
            port = parts.port
        except ValueError:
            parts, port = None, None
        if (
            parts is None
            or parts.scheme not in ("http", "https")
            or not parts.hostname
            or port is None
            or parts.username is not None
            or parts.path not in ("", "/")
            or parts.query
        ):
            raise ValueError(
                f"expected host:port or http(s)://host:port (no path, no credentials: use "
                f"alerts.otlp.headers), got {redact_url(value)!r}"
            )
        return value
    if "@" in value:  # user info: a credential the log would show with every delivery
        raise ValueError(
            "expected host:port or http(s)://host:port (no credentials: use alerts.otlp.headers), "
            f"got {SECRET + '@' + value.rpartition('@')[2]!r}"
        )
    _endpoint(value, text)
    if value.rpartition(":")[2] == "0":
        raise ValueError(f"expected host:port with a port from 1 to 65535, got {_shown(value)}")
    return value


def _optional_boolean(value: Any, text: bool) -> bool | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
        return None
    return _boolean(value, text)


_METADATA_KEY_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-_.")


def _headers(value: Any, text: bool) -> tuple[tuple[str, str], ...] | None:
    """gRPC metadata: a mapping, or ``key=value,key=value`` (``OTEL_EXPORTER_OTLP_HEADERS``
    syntax, URL-encoded values). Errors never repeat a value (it may be a credential), nor
    an item without ``=`` or a key that is not one word: a header line (``Authorization:
    Bearer …``) or a value cut at a comma holds the credential there."""
    if value is None or value == "" or value == {}:
        return None
    if isinstance(value, str):
        pairs = []
        items = [item for item in value.split(",") if item.strip()]
        for number, item in enumerate(items, 1):
            name, sep, raw = item.partition("=")
            if not sep:  # a header line ('Authorization: Bearer …'), or a value cut at a comma
                raise ValueError(
                    f"expected key=value pairs separated by commas (a comma in a value is %2C), "
                    f"item {number} of {len(items)} has no '=' (not shown)"
                )
            pairs.append((unquote(name).strip(), unquote(raw).strip()))
    elif isinstance(value, dict):
        # Values stripped as in the string form: a value of spaces is empty, so an error.
        pairs = [
            (str(name).strip(), raw.strip() if isinstance(raw, str) else raw) for name, raw in value.items()
        ]
    else:
        raise ValueError("expected a mapping of header names to values, or key=value,key=value")
    headers: dict[str, str] = {}
    for number, (name, raw) in enumerate(pairs, 1):
        key = name.lower()
        if any(c not in _METADATA_KEY_CHARS for c in key):
            # Not shown: a header line's key=value reading ('Authorization: Bearer dG9r=')
            # takes the credential into the key.
            raise ValueError(
                f"the key of item {number} of {len(pairs)} is not a valid gRPC metadata key "
                "(lowercase letters, digits, -_.; not shown); write key=value, e.g. authorization=Bearer%20…"
            )
        if not key or key.startswith("grpc-") or key.endswith("-bin"):
            raise ValueError(f"{name!r} is not a valid gRPC metadata key (lowercase letters, digits, -_.)")
        if not isinstance(raw, str) or not raw or any(not " " <= c <= "~" for c in raw):
            raise ValueError(f"header {key!r}: expected a non-empty printable ASCII string (value not shown)")
        headers[key] = raw
    return tuple(headers.items()) or None


@dataclass(frozen=True, slots=True)
class Option:
    """One setting: its file key, environment variable, flag, default and meaning."""

    key: str
    env: str
    parse: Callable[[Any, bool], Any]
    default: Any
    doc: str
    redact: Callable[[Any], Any] | None = None  # how a secret value is shown (config output, logs)

    @property
    def flag(self) -> str:
        return "--" + self.env.removeprefix(ENV_PREFIX).lower().replace("_", "-")

    @property
    def attr(self) -> str:
        return self.key.replace(".", "_")

    @property
    def boolean(self) -> bool:
        """A true/false setting: its flag alone means true (``--strict``)."""
        return self.parse in (_boolean, _optional_boolean)


OPTIONS: tuple[Option, ...] = (
    Option("receivers.grpc.endpoint", "DURABLE_SESSIONS_GRPC_ENDPOINT", _endpoint, "127.0.0.1:4319",
           "OTLP/gRPC listen address (TraceService/Export), host:port with no scheme, an IPv6 address in "
           "brackets ([::1]:4319); port 0 picks a free port"),
    Option("receivers.http.endpoint", "DURABLE_SESSIONS_HTTP_ENDPOINT", _endpoint, "127.0.0.1:4320",
           "HTTP listen address, host:port as receivers.grpc.endpoint: OTLP/HTTP POST /v1/traces, "
           "/api/sessions, /healthz, /metrics"),
    Option("receivers.http.max_connections", "DURABLE_SESSIONS_HTTP_MAX_CONNECTIONS", _positive_int, 256,
           "connections the HTTP port serves at once (a thread each); past it new connections wait "
           "in the listen backlog and idle keep-alive connections are closed to make room"),
    Option("receivers.max_request_bytes", "DURABLE_SESSIONS_MAX_REQUEST_BYTES", _request_bytes, 64 * MIB,
           "largest accepted Export request, after decompression (both receivers); at most "
           "2147483647 (2 GiB - 1), the largest message protobuf and gRPC take"),
    Option("receivers.max_decoding_bytes", "DURABLE_SESSIONS_MAX_DECODING_BYTES", _positive_int, GIB,
           "memory the Export requests decoded at once may take (both receivers), each weighed as "
           "its decompressed size times what decoding takes per byte (see Decoding memory); past it "
           "receivers answer 503 / UNAVAILABLE (retryable); a request alone is always decoded"),
    Option("pipeline.queue_size", "DURABLE_SESSIONS_QUEUE_SIZE", _positive_int, 64,
           "Export requests waiting to be written; past it receivers answer 503 / UNAVAILABLE"),
    Option("pipeline.retry_after_s", "DURABLE_SESSIONS_RETRY_AFTER_S", _seconds_int, 1,
           "least seconds a client is told to wait when the queue is full (Retry-After, RetryInfo): "
           "each refusal gets between this and twice this, at random"),
    Option("pipeline.max_batch", "DURABLE_SESSIONS_MAX_BATCH", _positive_int, 64,
           "most Export requests committed in one store transaction"),
    Option("pipeline.ack_timeout_s", "DURABLE_SESSIONS_ACK_TIMEOUT_S", _positive_number, 5.0,
           "longest a receiver waits for its records to be committed before answering UNAVAILABLE "
           "(retryable; below the OpenTelemetry SDK exporters' 10 s timeout, so they are answered)"),
    Option("store", "DURABLE_SESSIONS_STORE", _store_url, "sqlite:///durable-sessions.db",
           "where sessions are kept: sqlite:///PATH (relative path) or sqlite:////abs/path; or "
           "postgresql://USER@HOST:PORT/DB[?schema=NAME] shared by several replicas (password never logged)",
           redact=_hide_store),
    Option("retention.sessions_s", "DURABLE_SESSIONS_RETENTION_S", _non_negative_number, 0.0,
           "seconds an ended session is kept after its last span; older ones are deleted with their "
           "actions, violations and delivered or dead alerts (see Retention); 0 keeps everything"),
    Option("evaluation.idle_s", "DURABLE_SESSIONS_IDLE_S", _positive_number, 30.0,
           "a session idle this long is ended: its end-of-session rules run"),
    Option("evaluation.key_window_s", "DURABLE_SESSIONS_KEY_WINDOW_S", _positive_number, 86400.0,
           "how long a provider keeps idempotency keys (key-outlived-window)"),
    Option("evaluation.strict", "DURABLE_SESSIONS_STRICT", _boolean, False,
           "also run the strict-only rules (dead-end); verdicts count only the rules run"),
    Option("evaluation.max_sessions", "DURABLE_SESSIONS_MAX_SESSIONS", _positive_int, 10_000,
           "sessions held in memory; others are rebuilt from the store when their spans arrive"),
    Option("evaluation.max_actions_per_session", "DURABLE_SESSIONS_MAX_ACTIONS_PER_SESSION", _positive_int,
           100_000, "action ids one session remembers"),
    Option("evaluation.attribute_value_limit", "DURABLE_SESSIONS_ATTRIBUTE_VALUE_LIMIT",
           _optional_positive_int, None,
           "the senders' OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT, when known (truncated-result)"),
    Option("alerts.log.enabled", "DURABLE_SESSIONS_ALERT_LOG", _boolean, True,
           "write one JSON line per new violation to standard error"),
    Option("alerts.webhook.url", "DURABLE_SESSIONS_WEBHOOK_URL", _optional_url, None,
           "POST each new violation as JSON to this URL; user:password@ is sent as Basic auth; "
           "its credentials, path and query values are never logged; a space, control or non-ASCII "
           "character in its path or query must be percent-encoded", redact=_hide_webhook_url),
    Option("alerts.webhook.max_attempts", "DURABLE_SESSIONS_WEBHOOK_MAX_ATTEMPTS", _positive_int, 8,
           "webhook delivery attempts before an alert goes to the dead letter"),
    Option("alerts.webhook.timeout_s", "DURABLE_SESSIONS_WEBHOOK_TIMEOUT_S", _positive_number, 5.0,
           "longest one webhook POST may take before it counts as a failed attempt"),
    Option("alerts.webhook.backoff_s", "DURABLE_SESSIONS_WEBHOOK_BACKOFF_S", _positive_number, 1.0,
           "wait before the first retry; doubled after each failed attempt, with jitter"),
    Option("alerts.webhook.max_backoff_s", "DURABLE_SESSIONS_WEBHOOK_MAX_BACKOFF_S", _positive_number, 300.0,
           "longest wait between two webhook attempts (also caps a receiver's Retry-After)"),
    Option("alerts.otlp.endpoint", "DURABLE_SESSIONS_ALERTS_OTLP_ENDPOINT", _otlp_endpoint, None,
           "send each new violation as an OpenTelemetry log record over OTLP/gRPC (LogsService/Export) "
           "to this host:port, http://host:port or https://host:port, e.g. an OpenTelemetry Collector"),
    Option("alerts.otlp.insecure", "DURABLE_SESSIONS_ALERTS_OTLP_INSECURE", _optional_boolean, None,
           "true: plaintext gRPC, false: TLS (system CAs; GRPC_DEFAULT_SSL_ROOTS_FILE_PATH for others); "
           "unset: plaintext for http:// and loopback host:port, TLS otherwise; https:// is always TLS"),
    Option("alerts.otlp.headers", "DURABLE_SESSIONS_ALERTS_OTLP_HEADERS", _headers, None,
           "gRPC metadata sent with each Export: a mapping, or key=value,key=value as "
           "OTEL_EXPORTER_OTLP_HEADERS; values are never logged", redact=_hide_headers),
    Option("alerts.otlp.max_attempts", "DURABLE_SESSIONS_ALERTS_OTLP_MAX_ATTEMPTS", _positive_int, 8,
           "OTLP log delivery attempts before an alert goes to the dead letter"),
    Option("alerts.otlp.timeout_s", "DURABLE_SESSIONS_ALERTS_OTLP_TIMEOUT_S", _positive_number, 10.0,
           "deadline of one OTLP Export before it counts as a failed attempt"),
    Option("alerts.otlp.backoff_s", "DURABLE_SESSIONS_ALERTS_OTLP_BACKOFF_S", _positive_number, 1.0,
           "wait before the first OTLP retry; doubled after each failed attempt, with jitter"),
    Option("alerts.otlp.max_backoff_s", "DURABLE_SESSIONS_ALERTS_OTLP_MAX_BACKOFF_S", _positive_number, 300.0,
           "longest wait between two OTLP attempts (also caps a receiver's RetryInfo delay)"),
    Option("tls.cert_file", "DURABLE_SESSIONS_TLS_CERT_FILE", _optional_file, None,
           "PEM certificate (chain) served on both ports; set with tls.key_file to require TLS; "
           "both are loaded again when they change"),
    Option("tls.key_file", "DURABLE_SESSIONS_TLS_KEY_FILE", _optional_file, None,
           "PEM private key of tls.cert_file, unencrypted (one with a passphrase is refused)"),
    Option("tls.client_ca_file", "DURABLE_SESSIONS_TLS_CLIENT_CA_FILE", _optional_file, None,
           "PEM CA certificate(s): clients must present a certificate they signed (mutual TLS, "
           "as configtls's client_ca_file), on both ports, /healthz included; loaded again when it "
           "changes; needs tls.cert_file"),
    Option("auth.token", "DURABLE_SESSIONS_AUTH_TOKEN", _optional_token, None,
           "bearer token required on both ports (Authorization: Bearer …, gRPC authorization "
           "metadata), except GET /healthz and gRPC grpc.health.v1.Health/Check; never logged", redact=_hide),
    Option("auth.token_file", "DURABLE_SESSIONS_AUTH_TOKEN_FILE", _optional_file, None,
           "file holding the bearer token (instead of auth.token), as bearertokenauth's filename; "
           "re-read when it changes"),
    Option("log_level", "DURABLE_SESSIONS_LOG_LEVEL", _log_level, "INFO",
           "operational log level (alert lines are always written when enabled)"),
)  # fmt: skip

_BY_KEY = {option.key: option for option in OPTIONS}


@dataclass(frozen=True, slots=True)
class Config:
    """The resolved configuration (see :data:`OPTIONS` for each field's meaning and default;
    :func:`load` builds it, so that the defaults have one source)."""

    receivers_grpc_endpoint: str
    receivers_http_endpoint: str
    receivers_http_max_connections: int
    receivers_max_request_bytes: int
    receivers_max_decoding_bytes: int
    pipeline_queue_size: int
    pipeline_retry_after_s: int
    pipeline_max_batch: int
    pipeline_ack_timeout_s: float
    store: str
    retention_sessions_s: float
    evaluation_idle_s: float
    evaluation_key_window_s: float
    evaluation_strict: bool
    evaluation_max_sessions: int
    evaluation_max_actions_per_session: int
    evaluation_attribute_value_limit: int | None
    alerts_log_enabled: bool
    alerts_webhook_url: str | None
    alerts_webhook_max_attempts: int
    alerts_webhook_timeout_s: float
    alerts_webhook_backoff_s: float
    alerts_webhook_max_backoff_s: float
    alerts_otlp_endpoint: str | None
    alerts_otlp_insecure: bool | None
    alerts_otlp_headers: tuple[tuple[str, str], ...] | None = field(repr=False)
    alerts_otlp_max_attempts: int
    alerts_otlp_timeout_s: float
    alerts_otlp_backoff_s: float
    alerts_otlp_max_backoff_s: float
    tls_cert_file: str | None
    tls_key_file: str | None
    tls_client_ca_file: str | None
    auth_token: str | None = field(repr=False)
    auth_token_file: str | None
    log_level: str
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    def bearer_token(self) -> str | None:
        """The token clients must send: ``auth.token``, or the contents of ``auth.token_file``."""
        if self.auth_token is not None:
            return self.auth_token
        if self.auth_token_file is not None:
            try:
                return read_token_file(self.auth_token_file)
            except ValueError as error:
                raise ConfigError(f"auth.token_file: {error}") from None
        return None

    def secrets(self) -> list[str]:
        """Strings that must never appear in a log line."""
        found: list[str] = []
        token = self.bearer_token()
        if token:
            found.append(token)
        if self.alerts_webhook_url:
            found.extend(url_secrets(self.alerts_webhook_url))
        for _, value in self.alerts_otlp_headers or ():
            # The value, and its credentials alone ("Bearer <credentials>"). Short values (a
            # tenant id) would blank out every occurrence in the log.
            found.extend(part for part in {value, *value.split()[-1:]} if len(part) >= MIN_SECRET_CHARS)
        # Shorter ones are hidden where the URL is printed (redact_store_url), and in the
        # CLI's store errors (store_secrets whatever their length).
        found.extend(secret for secret in store_secrets(self.store) if len(secret) >= MIN_SECRET_CHARS)
        return found

    def display(self) -> dict[str, Any]:
        """Every setting by key, secrets redacted (``config`` command output)."""
        shown: dict[str, Any] = {}
        for option in OPTIONS:
            value = getattr(self, option.attr)
            shown[option.key] = option.redact(value) if option.redact is not None else value
        return shown

    @property
    def store_path(self) -> str:
        """The SQLite file of ``store`` (``sqlite:///x.db`` is relative, ``sqlite:////x.db`` absolute)."""
        return self.store.removeprefix("sqlite:///")


def load(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Resolve the configuration: defaults, then ``path``, then ``env``, then ``overrides``.

    ``overrides`` maps dotted keys (or flag attribute names) to values given as strings
    on the command line. ``path`` defaults to ``$DURABLE_SESSIONS_CONFIG`` when set.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {option.key: option.default for option in OPTIONS}
    sources: dict[str, str] = dict.fromkeys(values, "default")
    given = ""
    if path is None and env.get(CONFIG_ENV, "").strip():
        # Without surrounding whitespace, as every setting: a ConfigMap's value ends in a
        # line break. A blank one reads no file, as an empty one does.
        path, given = env[CONFIG_ENV].strip(), f" (from {CONFIG_ENV})"
    if path is not None and not os.fspath(path).strip():
        # --config "$CONFIG" with CONFIG unset: Path("") is ".", which was read as the file
        # ("cannot read configuration file '.': Is a directory").
        raise ConfigError("--config: an empty path; give the file, or leave --config out")
    if path is not None:
        for key, (value, where) in _read_file(Path(path), given).items():
            values[key] = _parse(_BY_KEY[key], value, text=False, source=where)
            sources[key] = where
    for option in OPTIONS:
        if option.env in env:
            _override(option, env[option.env], option.env, values, sources)
    for name, value in (overrides or {}).items():
        if value is None:
            continue
        option = _BY_KEY.get(name) or next((o for o in OPTIONS if o.attr == name), None)
        if option is None:
            raise ConfigError(f"{name}: unknown setting")
        _override(option, value, option.flag, values, sources)
    _check_together(values, sources)
    return Config(**{_BY_KEY[key].attr: value for key, value in values.items()}, sources=sources)


PROTECTIONS = frozenset(
    {"auth.token", "auth.token_file", "tls.cert_file", "tls.key_file", "tls.client_ca_file"}
)
"""Settings that protect the ports: an empty variable or flag may not turn off one that an
earlier source (the file, a variable) set."""


def _override(
    option: Option, value: Any, source: str, values: dict[str, Any], sources: dict[str, str]
) -> None:
    """``option`` set to ``value`` (a string from a variable or a flag) from ``source``.

    An empty value unsets an optional setting, except one of :data:`PROTECTIONS` set
    before: ``DURABLE_SESSIONS_AUTH_TOKEN=`` (Compose writes ``${TOKEN}`` of an unset
    ``TOKEN`` so) quietly turned off the token the file requires, and the sidecar served
    everyone."""
    parsed = _parse(option, value, text=isinstance(value, str), source=source)
    if parsed is None and option.key in PROTECTIONS and values[option.key] is not None:
        raise ConfigError(
            f"{option.key}: {source} is empty, which would turn off the {option.key} set in "
            f"{sources[option.key]}; leave {source} out to keep it, or remove the setting there"
        )
    values[option.key] = parsed
    sources[option.key] = source


def _check_together(values: dict[str, Any], sources: dict[str, str]) -> None:
    """Settings that are only valid in pairs."""
    cert, key = values.get("tls.cert_file"), values.get("tls.key_file")
    if (cert is None) != (key is None):
        missing, given = (
            ("tls.key_file", "tls.cert_file") if key is None else ("tls.cert_file", "tls.key_file")
        )
        raise _key_error(missing, f"required when {given} is set", sources[given])
    if values.get("tls.client_ca_file") is not None and cert is None:
        raise _key_error(
            "tls.cert_file", "required when tls.client_ca_file is set", sources["tls.client_ca_file"]
        )
    _check_receiver_ports(values, sources)
    if values.get("auth.token") is not None and values.get("auth.token_file") is not None:
        raise _key_error(
            "auth.token_file",
            f"set either auth.token or auth.token_file, not both; auth.token is set in {sources['auth.token']}",
            sources["auth.token_file"],
        )
    if values.get("auth.token_file") is not None:
        try:
            read_token_file(values["auth.token_file"])
        except ValueError as error:
            raise _key_error("auth.token_file", str(error), sources["auth.token_file"]) from None
    for channel in ("webhook", "otlp"):
        low, high = values.get(f"alerts.{channel}.backoff_s"), values.get(f"alerts.{channel}.max_backoff_s")
        if low is not None and high is not None and low > high:
            raise _key_error(
                f"alerts.{channel}.max_backoff_s",
                f"must be at least alerts.{channel}.backoff_s ({low:g}), got {high:g}",
                sources[f"alerts.{channel}.max_backoff_s"],
            )


def _check_receiver_ports(values: dict[str, Any], sources: dict[str, str]) -> None:
    """The two receivers on one port of one address: the second bind failed with "Address
    already in use", which sent the user looking for another process holding the port."""
    grpc, http = values["receivers.grpc.endpoint"], values["receivers.http.endpoint"]
    grpc_host, _, grpc_port = grpc.rpartition(":")
    http_host, _, http_port = http.rpartition(":")
    if int(grpc_port) == 0 or int(grpc_port) != int(http_port):
        return
    # grpcio listens on every address of a name (localhost: 127.0.0.1 and ::1); the HTTP
    # server, on a name's IPv4 address.
    http_addresses = {"127.0.0.1"} if http_host.lower() == "localhost" else _addresses(http_host)
    if not any(_same_address(a, b) for a in _addresses(grpc_host) for b in http_addresses):
        return
    raise _key_error(
        "receivers.http.endpoint",
        f"{http} takes the port of receivers.grpc.endpoint ({grpc}, from {sources['receivers.grpc.endpoint']}); "
        "each receiver needs its own port",
        sources["receivers.http.endpoint"],
    )


_WILDCARDS = {"0.0.0.0": 4, "::": None}
"""Addresses that listen on every address: of IPv4, or of both families (grpcio and the
HTTP server listen on ``::`` dual-stack)."""


def _same_address(first: str, second: str) -> bool:
    """Whether listening on one port of both addresses binds one address twice."""
    return first == second or _covers(first, second) or _covers(second, first)


def _addresses(host: str) -> set[str]:
    """The addresses a listen on ``host`` binds, as far as the configuration tells."""
    host = host.strip("[]").lower()
    return {"127.0.0.1", "::1"} if host == "localhost" else {host}


def _covers(wildcard: str, address: str) -> bool:
    if wildcard not in _WILDCARDS:
        return False
    family = _WILDCARDS[wildcard]
    try:
        return family is None or ipaddress.ip_address(address).version == family
    except ValueError:  # a host name: it may resolve to any address
        return True


def _parse(option: Option, value: Any, *, text: bool, source: str) -> Any:
    try:
        return option.parse(value, text)
    except ValueError as error:
        raise _key_error(option.key, str(error), source) from None


class _InFile(str):
    """Where in the file a key is: ``FILE:LINE:COLUMN`` (a source, as a variable's name is)."""

    __slots__ = ()


def _key_error(key: str, message: str, source: str) -> ConfigError:
    """``FILE:LINE:COLUMN: KEY: message`` for a key of the file, as compilers place their
    errors (editors and CI annotations jump there); ``KEY: message (from SOURCE)`` for a
    variable or a flag."""
    if isinstance(source, _InFile):
        return ConfigError(f"{source}: {key}: {message}")
    return ConfigError(f"{key}: {message} (from {source})")


MAX_FILE_BYTES = MIB
"""Most a configuration file is read of: ``--config`` given the store (meant for
``--store``) read gigabytes into memory, and a device (``/dev/zero``) without end."""


def _read_file(path: Path, given: str = "") -> dict[str, tuple[Any, str]]:
    """The file's settings: dotted key -> (value, ``path:line:column`` of its key).
    ``given``: where the path came from, said when the file cannot be read (a variable set
    in a profile or an image is easily forgotten)."""
    try:
        with path.open("rb") as file:
            data = file.read(MAX_FILE_BYTES + 1)
    except OSError as error:
        raise ConfigError(
            f"cannot read configuration file {str(path)!r}{given}: {error.strerror or error}"
        ) from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(
            f"{path}: more than {MAX_FILE_BYTES} bytes, which no configuration file needs; is it the file meant?"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        column = error.start - (data.rfind(b"\n", 0, error.start) + 1) + 1  # in bytes
        raise ConfigError(
            f"{path}:{line}:{column}: not UTF-8 text (byte 0x{data[error.start]:02x}); save the file as UTF-8"
        ) from None
    try:
        document, lines = _ConfigLoader.load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error)
        context, context_mark = getattr(error, "context", None), getattr(error, "context_mark", None)
        if context and context_mark is not None and problem in _RELATIVE_PROBLEMS:
            problem = f"{context} at {context_mark.line + 1}:{context_mark.column + 1}, {problem}"
        if "'\\t'" in problem:  # PyYAML's words alone do not say what to do about it
            problem += " (YAML allows no tab there: use spaces)"
        raise ConfigError(f"{path}{where}: not valid YAML: {problem}") from None
    except RecursionError:  # PyYAML composes and constructs nested nodes by recursion
        raise ConfigError(f"{path}: lists or mappings nested too deeply to read") from None
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise ConfigError(f"{path}: expected a mapping of settings at the top level")
    flat: dict[str, tuple[Any, str]] = {}
    _flatten(document, "", flat, _Lines(path, lines))
    return flat


_RELATIVE_PROBLEMS = frozenset({"but found another document", "second occurrence"})
"""PyYAML's problems that say nothing without their context ("expected a single document
in the stream", "found duplicate anchor 'a'; first occurrence")."""


def _unbuildable(error: ValueError) -> str:
    """Why PyYAML could not build a value it parsed: a date that does not exist
    (``2026-02-30``, read as a timestamp) or an integer past ``int``'s text limit."""
    if "integer string conversion" in str(error):
        return "an integer of more than 4300 digits"
    return f"a value that looks like a date or time but is none ({error}): quote it to give text"


class _ConfigLoader(yaml.SafeLoader):
    """``yaml.safe_load``, but a key given twice in one mapping is an error rather than
    the last one winning, and the line of every key is kept (``lines``: a mapping's id ->
    its keys' places) so that errors about a value can say where it is."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.lines: dict[int, dict[Any, tuple[int, int]]] = {}

    @classmethod
    def load(cls, text: str) -> tuple[Any, dict[int, dict[Any, tuple[int, int]]]]:
        """The document in ``text`` and its keys' (line, column); raises :class:`yaml.YAMLError`."""
        loader = cls(text)
        try:
            return loader.get_single_data(), loader.lines
        finally:
            loader.dispose()

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        """PyYAML's, with a scalar it cannot build (a ``ValueError`` out of ``int`` or
        ``datetime``, which ended start-up in a traceback) a YAML error at its place."""
        try:
            return super().construct_object(node, deep=deep)
        except ValueError as error:
            raise yaml.constructor.ConstructorError(
                None, None, _unbuildable(error), node.start_mark
            ) from None

    def construct_lined_mapping(self, node: yaml.MappingNode) -> Iterator[dict[Any, Any]]:
        mapping: dict[Any, Any] = {}
        yield mapping
        lines = self.lines[id(mapping)] = {}
        merged_at = None
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                # merged keys (<<: *anchor) may be given again: that is what they are for
                merged_at = _place(key_node)
                continue
            key = self.construct_object(key_node)
            with contextlib.suppress(TypeError):  # an unhashable key: construct_mapping says so
                if key in lines:
                    raise yaml.constructor.ConstructorError(
                        "while reading a mapping",
                        node.start_mark,
                        f"{key!r} is given twice (first at line {lines[key][0]}); merge the two",
                        key_node.start_mark,
                    )
                lines[key] = _place(key_node)
        mapping.update(self.construct_mapping(node))
        if merged_at is not None:
            for key in mapping.keys() - lines.keys():
                lines[key] = merged_at


_ConfigLoader.add_constructor("tag:yaml.org,2002:map", _ConfigLoader.construct_lined_mapping)


def _place(node: yaml.Node) -> tuple[int, int]:
    """Where ``node`` starts: (line, column), both from 1."""
    return node.start_mark.line + 1, node.start_mark.column + 1


@dataclass(frozen=True)
class _Lines:
    """Where the keys of the file's mappings are: ``path:line:column``."""

    path: Path
    lines: dict[int, dict[Any, tuple[int, int]]]

    def of(self, mapping: dict[Any, Any], key: Any) -> _InFile:
        place = self.lines.get(id(mapping), {}).get(key)
        return _InFile(f"{self.path}:{place[0]}:{place[1]}" if place is not None else self.path)


def _flatten(node: dict[Any, Any], prefix: str, out: dict[str, tuple[Any, str]], lines: _Lines) -> None:
    """Each setting of ``node`` (a mapping of the file at ``prefix``) into ``out``.

    A dotted key (``evaluation.idle_s: 5``) is refused: the file nests its keys, and a
    dotted one could give a setting a second time, which the loader refuses for a key
    given twice in one mapping (the last one would quietly win)."""
    for raw_key, value in node.items():
        key = f"{prefix}{raw_key}"
        where = lines.of(node, raw_key)
        if isinstance(raw_key, str) and "." in raw_key and _is_known(key):
            raise _key_error(key, f"write the key nested in the file, {_nested(key)}", where)
        if key in _BY_KEY:
            out[key] = (value, where)
        elif value is None and any(k.startswith(key + ".") for k in _BY_KEY):
            pass  # a section left empty (its settings commented out): its defaults, as in an OTel Collector
        elif isinstance(value, dict) and any(k.startswith(key + ".") for k in _BY_KEY):
            _flatten(value, key + ".", out, lines)
        elif any(k.startswith(key + ".") for k in _BY_KEY):
            # The value is not shown: a section given one is most often a secret put a level
            # too high (``auth: TOKEN``, ``alerts: {webhook: https://hooks…/SECRET}``).
            example = _nested(next(k for k in _BY_KEY if k.startswith(key + ".")))
            raise _key_error(
                key, f"expected a mapping of settings, e.g. {example}, got {_kind(value)}", where
            )
        else:
            known = sorted(k for k in _BY_KEY if k.startswith(prefix)) if prefix else sorted(_BY_KEY)
            suggestion = _suggestion(str(raw_key), prefix)
            raise _key_error(key, f"unknown setting{suggestion}; known: {', '.join(known)}", where)


def _suggestion(name: str, prefix: str) -> str:
    """``; did you mean KEY?`` for the name of this section (``prefix``) closest to a
    misspelt ``name`` (``reciever``, ``idel_s``), or nothing when none is close."""
    names = {k.removeprefix(prefix).partition(".")[0] for k in _BY_KEY if k.startswith(prefix)}
    close = closest(name, names)
    return f"; did you mean {prefix}{close}?" if close else ""


def closest(name: str, names: Iterable[str]) -> str | None:
    """The one of ``names`` closest to a misspelt ``name``, or None when none is close: a
    file's key (``idel_s``) or an environment variable's name (``IDEL_S``)."""
    close = difflib.get_close_matches(name, sorted(names), n=1, cutoff=0.6)
    return close[0] if close else None


def _kind(value: Any) -> str:
    """What ``value`` is, in words, without showing it."""
    kinds = {str: "a string", bool: "a boolean", int: "a number", float: "a number", list: "a list"}
    return f"{kinds.get(type(value), type(value).__name__)} (not shown)"


def _is_known(key: str) -> bool:
    """Whether ``key`` is a setting or a section of settings."""
    return key in _BY_KEY or any(k.startswith(key + ".") for k in _BY_KEY)


def _nested(key: str) -> str:
    """``a.b.c`` as the file writes it: ``a: {b: {c: …}}``."""
    head, _, rest = key.partition(".")
    return f"{head}: {{{_nested(rest)}}}" if rest else f"{head}: …"


def is_loopback(endpoint: str) -> bool:
    """Whether ``endpoint`` (``host:port``, an IPv6 host in brackets) is on this machine."""
    return is_loopback_host(endpoint.rpartition(":")[0].strip("[]"))


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (a name or an address, an IPv6 one without brackets, as
    ``urlsplit``'s ``hostname`` gives it) is this machine."""
    if host.lower() == "localhost":  # a host name in any case
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    # ::ffff:127.0.0.1 is 127.0.0.1 (Python before 3.13 does not say it is loopback).
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def reference() -> str:
    """The configuration reference as a Markdown table."""
    lines = [
        "| key | environment variable | flag | default | meaning |",
        "|---|---|---|---|---|",
    ]
    for option in OPTIONS:
        default = "unset" if option.default is None else f"`{option.default}`"
        flag = option.flag + (" {true,false}" if option.boolean else "")
        lines.append(f"| `{option.key}` | `{option.env}` | `{flag}` | {default} | {option.doc} |")
    return "\n".join(lines) + "\n"
