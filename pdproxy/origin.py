"""Backend URLs: where to connect, what ``Host`` to send, and which path prefix to keep.

One function, :func:`split_url`, turns every upstream URL (a backend's base URL, or a base URL
plus a path such as the health path) into an :class:`Origin` and a request target. Legs, health
checks, model lists and releases all go through it, so a backend behind a path prefix
(``http://gw:80/engine-3``) gets the prefix on every call, not only on some.

IPv6 literals are written in brackets in URLs (``http://[::1]:8100``) and in the ``Host``
header, and without them when connecting, like httpcore and aiohttp do.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

_DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True, slots=True)
class Origin:
    """Scheme, host and port of an upstream: one keep-alive pool each."""

    tls: bool
    host: str
    """As given to ``connect()``: an IPv6 literal has no brackets."""
    port: int
    host_header: str
    """The ``Host`` header value: brackets around IPv6 literals, the port unless default."""

    @property
    def display(self) -> str:
        """``host:port`` for messages and logs (brackets kept for IPv6)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def split_url(url: str) -> tuple[Origin, str]:
    """``http://h:p/prefix/a?q`` -> (the origin, ``/prefix/a?q``); ValueError if unusable.

    Query strings pass through untouched; a fragment, user info or a non-http(s) scheme is
    refused rather than silently dropped. Messages never echo the URL: it may carry credentials
    and reaches config errors and logs.
    """
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"not a usable URL ({exc})") from exc
    default_port = _DEFAULT_PORTS.get(parts.scheme)
    if default_port is None or not parts.hostname:
        raise ValueError("not an http(s) URL with a host")
    if parts.username is not None or parts.password is not None:
        raise ValueError("user info (user:password@) in an upstream URL is not supported")
    if parts.fragment:
        raise ValueError("a fragment in an upstream URL means nothing upstream")
    host = parts.hostname  # lower-cased, brackets removed
    port = port or default_port
    named = f"[{host}]" if ":" in host else host
    host_header = named if port == default_port else f"{named}:{port}"
    target = parts.path or "/"
    if parts.query:
        target = f"{target}?{parts.query}"
    return Origin(parts.scheme == "https", host, port, host_header), target


def base_prefix(base_url: str) -> tuple[Origin, str]:
    """A backend's base URL -> (origin, path prefix without trailing slash, "" for none).

    ``prefix + "/v1/completions"`` is then exactly the target :func:`split_url` gives for
    ``base_url + "/v1/completions"``: the two ways of calling a backend cannot disagree.
    """
    origin, target = split_url(base_url)
    if "?" in target:
        raise ValueError("a backend base URL cannot carry a query")
    return origin, target.rstrip("/")
