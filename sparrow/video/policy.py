"""Which paths and URLs a video may be read from.

The service always passes a SourcePolicy; `load_frames(..., policy=None)` is the library's
permissive local default: any local path (as `open()` would take it), and no URL at all.
Bytes, file-like objects, frame arrays and live sources carry their data with them and
need no allowlist.
"""

from __future__ import annotations

import os
import pathlib
import re
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass

from sparrow.errors import InvalidRequest, SourceNotAllowed

# Schemes FFmpeg may fetch for us. "file" is never allowed: local files go through the
# media root, which resolves symlinks and "..", and FFmpeg's own file protocol would not.
URL_SCHEMES = frozenset({"http", "https", "rtsp"})

# A string is a URL when it starts with "scheme://"; anything else is a path. Paths are
# opened by Python, never handed to FFmpeg, so "concat:a|b" is just an odd file name.
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")

# Characters on which URL parsers disagree (Python vs FFmpeg): refusing them keeps the URL
# we checked the URL FFmpeg fetches.
_AMBIGUOUS = re.compile(r"[\x00-\x20\x7f\\@]")

# The port a URL without one reaches, per scheme: "https://h/" and "https://h:443/" are one origin.
DEFAULT_PORTS = {"http": 80, "https": 443, "rtsp": 554}


def is_url(source: object) -> bool:
    return isinstance(source, str) and bool(_URL.match(source))


def shown(text: object, limit: int = 120) -> str:
    """`text` quoted for an error message, cut to `limit` characters: a message never
    echoes unbounded input (a 10k-character path would overflow gRPC's metadata)."""
    text = str(text)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


@dataclass(frozen=True, slots=True)
class SplitUrl:
    """A URL read once, strictly (split_url): what an allowlist compares and a fetch reaches."""

    scheme: str            # lower case
    host: str              # lower case; an IPv6 literal without its brackets
    port: int              # the URL's own, else its scheme's default (DEFAULT_PORTS)
    explicit_port: bool    # the URL names its port
    path: str
    query: str

    @property
    def netloc(self) -> str:
        """host[:port], the port as a plain number: the form handed on, so it is the one checked."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}" if self.explicit_port else host

    def geturl(self) -> str:
        """The canonical URL (no fragment: it never reaches the server)."""
        return urllib.parse.urlunsplit((self.scheme, self.netloc, self.path, self.query, ""))


def split_url(url: str) -> SplitUrl:
    """`url`'s scheme, host, port and path, or SourceNotAllowed for a URL that two parsers
    could read apart: spaces, control characters, backslashes, user info ("user:pass@") and
    non-ASCII characters are refused, as are an empty, non-numeric or out-of-range (not
    1..65535) port, a missing host, and a scheme with no default port that names none."""
    if _AMBIGUOUS.search(url) or not url.isascii():
        raise SourceNotAllowed("URLs with spaces, control characters, backslashes, user info ('@') "
                               "or non-ASCII characters are not allowed; percent-encode them")
    try:
        parts = urllib.parse.urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError as exc:  # a port that is not a number, or past 65535
        raise SourceNotAllowed(f"malformed URL: {shown(str(exc))}") from exc
    scheme = parts.scheme.lower()
    if not host:
        raise SourceNotAllowed(f"the URL {shown(url)} names no host")
    if parts.netloc.endswith(":") or port == 0:  # "host:" (FFmpeg reads port 0) or "host:0"
        raise SourceNotAllowed(f"the URL {shown(url)} names no usable port (1..65535)")
    if port is None and scheme not in DEFAULT_PORTS:
        raise SourceNotAllowed(f"the URL {shown(url)} names no port, and {shown(scheme)} has no default one")
    return SplitUrl(scheme, host, port if port is not None else DEFAULT_PORTS[scheme], port is not None,
                    parts.path, parts.query)


@dataclass(frozen=True)
class SourcePolicy:
    """Allowlists for video sources.

    media_root: local paths are allowed only inside this directory (None: no local paths).
        Relative paths are taken relative to it; symlinks and ".." are resolved first, so a
        link that points out of the root is refused.
    allowed_schemes: URL schemes, a subset of {"http", "https", "rtsp"}.
    allowed_hosts: host names, exact ("cdn.example.com"), with a port ("cdn.example.com:8443"
        allows only that port; a URL naming none reaches its scheme's default), a subdomain wildcard ("*.example.com", not example.com itself),
        or "*" for any host. URLs with user info ("user@host") are refused, and http(s)
        redirects are never followed (FFmpeg could not check where they lead): give the final
        URL. RTSP is the exception: FFmpeg's RTSP demuxer follows a 3xx Location by itself and
        has no option to stop it, so an allowed RTSP host must be one trusted not to redirect
        (tests/test_edges.py keeps this as a known gap).
    tls_ca_file: PEM bundle of the CAs that https servers' certificates must chain to (None:
        the system's). Certificates are always verified: FFmpeg's own default is not to.
    """

    media_root: str | os.PathLike | None = None
    allowed_schemes: Iterable[str] = frozenset()
    allowed_hosts: Iterable[str] = frozenset()
    tls_ca_file: str | os.PathLike | None = None

    def __post_init__(self) -> None:
        schemes = frozenset(s.lower() for s in self.allowed_schemes)
        if not schemes <= URL_SCHEMES:
            raise InvalidRequest(f"allowed_schemes must be a subset of {sorted(URL_SCHEMES)}, got {sorted(schemes)}")
        object.__setattr__(self, "allowed_schemes", schemes)
        hosts = frozenset(h.lower() for h in self.allowed_hosts)
        for entry in hosts:
            _host_entry(entry)  # refuse a malformed entry now, not on the first request
        object.__setattr__(self, "allowed_hosts", hosts)
        if self.tls_ca_file is not None and not os.path.isfile(self.tls_ca_file):
            raise InvalidRequest(f"tls_ca_file {os.fspath(self.tls_ca_file)!r} is not a file")
        if self.media_root is not None:
            root = os.path.realpath(self.media_root)
            if not os.path.isdir(root):
                raise InvalidRequest(f"media_root {os.fspath(self.media_root)!r} is not a directory")
            object.__setattr__(self, "media_root", pathlib.Path(root))

    def resolve(self, source: str | os.PathLike) -> pathlib.Path | str:
        """The real path (pathlib.Path) or the canonical URL (str) to read `source` from.
        Raises SourceNotAllowed for anything outside the allowlists."""
        if is_url(source):
            return self.resolve_url(source)
        if isinstance(source, (str, os.PathLike)):
            return self.resolve_path(source)
        raise InvalidRequest(f"a policy resolves paths and URLs, got {type(source).__name__}")

    def contains(self, path: str | os.PathLike) -> bool:
        """Whether the real path of `path` lies inside the media root. A path that cannot be
        resolved (a component removed or swapped for a symlink while it was being resolved)
        does not: the caller refuses it rather than failing."""
        return self.media_root is not None and self._real_inside(path) is not None

    def _real_inside(self, path: str | os.PathLike) -> str | None:
        """The real path of `path` when it lies inside the media root, else None."""
        try:
            real = os.path.realpath(path)
            inside = os.path.commonpath([real, self.media_root]) == str(self.media_root)
        except (OSError, ValueError):        # ValueError: a relative path left after a failed resolve
            return None
        return real if inside else None

    def resolve_path(self, path: str | os.PathLike) -> pathlib.Path:
        """The real path of a local `path` (relative to the media root, or absolute inside
        it); SourceNotAllowed when it lies outside or local paths are not allowed."""
        raw = os.fspath(path)
        if isinstance(raw, bytes) or "\x00" in raw:
            raise SourceNotAllowed("a video path must be a text path without NUL characters")
        if self.media_root is None:
            raise SourceNotAllowed("local video paths are not allowed here; send the video's bytes or a URL")
        real = self._real_inside(self.media_root / raw)  # an absolute `raw` replaces the root, then must lie inside it
        if real is None:
            raise SourceNotAllowed(f"{shown(raw)} is outside the allowed media directory")
        return pathlib.Path(real)

    def resolve_url(self, url: str) -> str:
        """The canonical form of `url` ("scheme://host/..."); InvalidRequest for a string that
        is no URL (a scheme-less name is never taken for a local path here), SourceNotAllowed
        for a URL off the allowlists."""
        if not is_url(url):
            raise InvalidRequest(f"{shown(url)} is not a URL (scheme://host/...); a file in the media "
                                 "directory is sent as a path")
        scheme = url.split(":", 1)[0].lower()
        if scheme == "file":
            raise SourceNotAllowed("file:// URLs are not allowed; send a path inside the media directory")
        if scheme not in self.allowed_schemes:
            allowed = ", ".join(sorted(self.allowed_schemes)) or "none"
            raise SourceNotAllowed(f"URL scheme {shown(scheme)} is not allowed (allowed: {allowed})")
        parts = split_url(url)
        if not self._host_allowed(parts.host, parts.port):
            raise SourceNotAllowed(f"host {shown(parts.host)} is not in the allowed hosts")
        return parts.geturl()

    def _host_allowed(self, host: str, port: int) -> bool:
        for entry in self.allowed_hosts:
            name, entry_port = _host_entry(entry)
            if entry_port is not None and entry_port != port:
                continue  # a port-restricted entry admits that port only (the scheme's default included)
            if name == "*" or name == host or (name.startswith("*.") and host.endswith(name[1:])):
                return True
        return False


def _host_entry(entry: str) -> tuple[str, int | None]:
    """("cdn.example.com", 8443) from "cdn.example.com:8443"; IPv6 literals keep no brackets."""
    parts = urllib.parse.urlsplit("//" + entry)
    try:
        port = parts.port
    except ValueError as exc:
        raise InvalidRequest(f"allowed host {entry!r} is malformed: {exc}") from exc
    if port == 0 or parts.netloc.endswith(":"):
        raise InvalidRequest(f"allowed host {entry!r} is malformed: its port must be 1..65535")
    return (parts.hostname or entry), port
