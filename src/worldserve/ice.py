"""ICE servers named by one URL each: STUN, and TURN with its username and credential.

Owns: :class:`IceServer` (what an ``RTCIceServer`` holds; :meth:`IceServer.link`, the ``Link`` header a
WHIP/WHEP endpoint tells it to its clients in) and :func:`parse_ice_server`, the one form
both the server (``--ice-server``) and the Python WebRTC client take: ``stun:HOST[:PORT]``, and
``turn:USER:CREDENTIAL@HOST[:PORT][?transport=udp|tcp]`` (or ``turns:``), the user and credential
percent-encoded where they hold ``:`` or ``@``. RFC 7064/7065's URIs carry no credentials, so the
part before ``@`` is this project's, taken off before the URL reaches the ICE agent.
Must not know: aiortc, sockets. Standard library only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote

__all__ = ["IceServer", "parse_ice_links", "parse_ice_server"]

#: One link-value of a ``Link`` header: ``<URL>`` and its parameters (a quoted string may hold ``,`` and ``;``).
_LINK = re.compile(r'<([^>]*)>((?:\s*;\s*[\w-]+\s*=\s*(?:"(?:[^"\\]|\\.)*"|[^;,]*))*)')
_PARAM = re.compile(r'\s*;\s*([\w-]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^;,]*))')
_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:\d{1,5})?(\?transport=(udp|tcp))?$")


@dataclass(frozen=True, slots=True)
class IceServer:
    """One STUN or TURN server: its URL as the ICE agent takes it, and a TURN server's credentials."""

    url: str
    username: str | None = None
    credential: str | None = None

    def link(self) -> str:
        """This server as a WHIP/WHEP ``Link`` header's value (RFC 9725, 4.6): ``<URL>; rel="ice-server"``, and
        for TURN its ``username``, ``credential`` and ``credential-type="password"``, as quoted strings."""
        value = f'<{self.url}>; rel="ice-server"'
        if self.username is not None and self.credential is not None:
            value += f'; username="{_quoted(self.username)}"; credential="{_quoted(self.credential)}"'
            value += '; credential-type="password"'
        return value

    def __repr__(self) -> str:  # never the credential in a log line
        secret = "" if self.credential is None else ", credential=***"
        user = "" if self.username is None else f", username={self.username!r}"
        return f"IceServer({self.url!r}{user}{secret})"


def _quoted(text: str) -> str:
    """``text`` inside an HTTP quoted-string (RFC 9110, 5.6.4): a backslash before ``"`` and ``\\``."""
    return text.replace("\\", "\\\\").replace('"', '\\"')


def parse_ice_links(header: str | None) -> list[IceServer]:
    """The ICE servers in a WHIP/WHEP endpoint's ``Link`` header (what :meth:`IceServer.link` writes: links of
    ``rel="ice-server"``, a TURN server's ``username`` and ``credential`` as quoted strings); other links left."""
    found = []
    for url, params in _LINK.findall(header or ""):
        told = {
            name.lower(): re.sub(r"\\(.)", r"\1", quoted) if quoted or not bare else bare.strip()
            for name, quoted, bare in _PARAM.findall(params)
        }
        if told.get("rel") == "ice-server":
            found.append(IceServer(url, told.get("username"), told.get("credential")))
    return found


def parse_ice_server(text: str) -> IceServer:
    """``stun:HOST[:PORT]`` or ``turn[s]:USER:CREDENTIAL@HOST[:PORT][?transport=udp|tcp]``; ``ValueError``
    naming the form for anything else (a TURN server without credentials included: it needs them)."""
    scheme, colon, rest = text.partition(":")
    scheme = scheme.lower()
    if not colon or scheme not in ("stun", "stuns", "turn", "turns"):
        raise ValueError(f"an ICE server is stun:HOST[:PORT] or turn:USER:CREDENTIAL@HOST[:PORT]; got {text!r}.")
    userinfo, at, where = rest.rpartition("@")
    if not at:
        userinfo, where = "", rest
    if not _HOST.match(where) or (scheme.startswith("stun") and "?" in where):
        raise ValueError(f"the ICE server {text!r} names no HOST[:PORT] after its scheme (and, for TURN, its user).")
    if scheme.startswith("stun"):
        if at:
            raise ValueError(f"a STUN server takes no username or credential; got {text!r}.")
        return IceServer(f"{scheme}:{where}")
    user, colon, credential = userinfo.partition(":")
    if not at or not colon or not user or not credential:
        raise ValueError(f"a TURN server needs its username and credential: {scheme}:USER:CREDENTIAL@{where}.")
    return IceServer(f"{scheme}:{where}", unquote(user), unquote(credential))
