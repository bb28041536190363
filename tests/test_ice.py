"""ICE servers by URL (``--ice-server``, ``WebRTCWorldClient(ice_servers=...)``): STUN, and TURN with its
credentials, refused with a clear error in any other form; a real peer connection gets them."""

from __future__ import annotations

import pytest

from worldserve.ice import IceServer, parse_ice_server
from worldserve.server.config import ServerConfig


def test_stun_and_turn_urls_with_their_credentials() -> None:
    assert parse_ice_server("stun:stun.example:3478") == IceServer("stun:stun.example:3478")
    assert parse_ice_server("STUN:[2001:db8::1]") == IceServer("stun:[2001:db8::1]")
    assert parse_ice_server("turn:ana:s3cret@turn.example:3478?transport=tcp") == IceServer(
        "turn:turn.example:3478?transport=tcp", "ana", "s3cret"
    )
    # Percent-encoded, a credential may hold ':' and '@' (a TURN REST credential is base64: '/', '+', '=').
    assert parse_ice_server("turns:1733443200%3Aana:a%40b/c+d=@10.0.0.1:5349") == IceServer(
        "turns:10.0.0.1:5349", "1733443200:ana", "a@b/c+d="
    )


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("turn:turn.example:3478", "needs its username and credential"),
        ("turn:ana@turn.example", "needs its username and credential"),
        ("stun:ana:x@stun.example", "takes no username"),
        ("http://stun.example", "stun:HOST"),
        ("stun.example:3478", "stun:HOST"),
        ("stun:", "names no HOST"),
        ("turn:a:b@host:99999999", "names no HOST"),
        ("stun:host?transport=tcp", "names no HOST"),
    ],
)
def test_anything_else_is_refused_naming_the_form(url: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_ice_server(url)
    with pytest.raises(ValueError, match=why):  # at the server's start, not at its first peer
        ServerConfig(ice_servers=(url,))


def test_a_credential_never_shows_in_a_log_line() -> None:
    assert "s3cret" not in repr(parse_ice_server("turn:ana:s3cret@turn.example"))


def test_the_servers_and_the_clients_peer_connections_get_them() -> None:
    pytest.importorskip("aiortc")
    from worldserve.server.webrtc import peer_connection
    from worldserve.webrtc_client import WebRTCWorldClient

    pc = peer_connection(["stun:stun.example:3478", "turn:ana:s3cret@turn.example:3478"])
    servers = pc._RTCPeerConnection__configuration.iceServers  # pinned aiortc keeps it to itself
    assert [(s.urls, s.username, s.credential) for s in servers] == [
        ("stun:stun.example:3478", None, None),
        ("turn:turn.example:3478", "ana", "s3cret"),
    ]
    client = WebRTCWorldClient("ws://127.0.0.1:1/v1/world", ice_servers=["turn:ana:s3cret@turn.example"])
    assert client.ice_servers == (IceServer("turn:turn.example", "ana", "s3cret"),)
    with pytest.raises(ValueError, match="needs its username"):
        WebRTCWorldClient("ws://127.0.0.1:1/v1/world", ice_servers=["turn:turn.example"])


def test_each_server_as_the_link_header_a_whep_endpoint_tells_it_in() -> None:
    assert parse_ice_server("stun:stun.example:3478").link() == '<stun:stun.example:3478>; rel="ice-server"'
    turn = parse_ice_server("turn:a%22na:s%5C3%40cret@turn.example?transport=tcp")  # '"', '\' and '@' in them
    assert turn.link() == (
        '<turn:turn.example?transport=tcp>; rel="ice-server"; username="a\\"na"; credential="s\\\\3@cret";'
        ' credential-type="password"'
    )


def test_the_link_header_read_back_gives_the_servers_and_leaves_other_links() -> None:
    from worldserve.ice import parse_ice_links

    stun = parse_ice_server("stun:stun.example:3478")
    turn = parse_ice_server("turns:a%22n,a:s%5C3%40c;et@turn.example:5349?transport=tcp")  # ',' and ';' quoted
    header = ", ".join([stun.link(), '<https://docs.example/ice>; rel="help"', turn.link()])
    assert parse_ice_links(header) == [stun, turn]
    assert parse_ice_links(None) == parse_ice_links("") == []
