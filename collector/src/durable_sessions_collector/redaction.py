"""Secrets out of what the sidecar writes: :class:`RedactingStream`.

Kept apart from :mod:`.security` (which imports grpc) so that the command line can pass
its own messages through the same redactor without importing grpc before it has set
``GRPC_VERBOSITY`` (see :mod:`.cli`).
"""

from __future__ import annotations

import io
import json
import re
import sys
import threading
from collections.abc import Iterable
from typing import TextIO

_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


class RedactingStream(io.TextIOBase):
    """A text stream that writes to ``target`` (default: the current ``sys.stderr``)
    with every secret replaced by ``***``.

    In a JSON line (the log's), secrets are replaced inside its strings (keys and values)
    only, each string decoded and encoded again, so the line stays one valid JSON object
    whatever the secret (digits, ``true``, a backslash): a ``ts`` or a count is never
    touched. Any other text has every occurrence replaced, raw or JSON-escaped, line by
    line: a secret holding a line break is replaced where it is escaped (in a JSON
    string), not across two lines of text. No configured secret holds one where a message
    can quote it: a token is RFC 6750 characters, a header value printable ASCII, and a
    control character inside the webhook or store URL is refused (a percent-encoded
    ``%0A`` is decoded only where nothing prints it).
    """

    def __init__(self, target: TextIO | None, secrets: Iterable[str]) -> None:
        self.target = target
        raw: set[str] = set()
        forms: set[str] = set()
        for secret in secrets:
            if secret:
                raw.add(secret)
                forms.update(_forms(secret))
        self._lock = threading.Lock()
        self._raw: list[str] = []
        self._secrets: list[str] = []
        self._set(raw, forms)

    def add(self, secret: str) -> None:
        """Redact ``secret`` too from now on (a credential loaded while the sidecar runs)."""
        if secret:
            with self._lock:
                self._set({*self._raw, secret}, {*self._secrets, *_forms(secret)})

    def _set(self, raw: set[str], forms: set[str]) -> None:
        # Longest first, so a secret containing another is replaced whole.
        self._raw = sorted(raw, key=len, reverse=True)
        self._secrets = sorted(forms, key=len, reverse=True)

    def scrub(self, text: str) -> str:
        if not self._secrets or not any(secret in text for secret in self._secrets):
            return text
        return "".join(self._scrub_line(line) for line in text.splitlines(keepends=True))

    def _scrub_line(self, line: str) -> str:
        if line.lstrip().startswith("{"):
            scrubbed = _JSON_STRING.sub(self._scrub_json_string, line)
            try:
                json.loads(scrubbed)
            except ValueError:
                pass  # not JSON after all: the text may hold a secret outside "…"
            else:
                return scrubbed  # a digit secret may remain in a number: that shows nothing
        return _replace(line, self._secrets)

    def _scrub_json_string(self, match: re.Match[str]) -> str:
        literal = match.group()
        if not any(secret in literal for secret in self._secrets):
            return literal
        try:
            value = json.loads(literal)
        except ValueError:
            return _replace(literal, self._secrets)
        return json.dumps(_replace(value, self._raw), ensure_ascii=False)

    def write(self, text: str) -> int:
        stream = self.target or sys.stderr
        if stream is None:  # started with standard error closed (2>&-): the lines go nowhere
            return len(text)
        with self._lock:
            stream.write(self.scrub(text))
        return len(text)

    def flush(self) -> None:
        stream = self.target or sys.stderr
        if stream is not None:
            stream.flush()


def _forms(secret: str) -> set[str]:
    """``secret`` as it may appear in a line: raw, and escaped inside a JSON string."""
    return {secret, json.dumps(secret, ensure_ascii=False)[1:-1], json.dumps(secret)[1:-1]}


def _replace(text: str, secrets: Iterable[str]) -> str:
    for secret in secrets:
        if secret in text:
            text = text.replace(secret, "***")
    return text
