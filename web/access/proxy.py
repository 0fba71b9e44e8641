"""What a request says about itself through a reverse proxy: its request id and its client.

An incoming `X-Request-Id` is kept when it is well-formed, so one id follows a request from
nginx into the PC's log. `X-Forwarded-For` is believed only as far as the hops that appended
to it are trusted proxies (`--trusted-proxies`); anyone else could have written it.
This module knows nothing of Flask: it reads strings and answers strings.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address

REQUEST_ID_HEADER = "X-Request-Id"
MAX_REQUEST_ID_CHARS = 128
# Letters, digits and . _ : - only: an id goes into log lines and response headers as it is.
_REQUEST_ID = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_REQUEST_ID_CHARS}}}")


def request_id_from(headers: Mapping[str, str]) -> str | None:
    """The client's or proxy's `X-Request-Id` if it is well-formed, else None (make one)."""
    value = headers.get(REQUEST_ID_HEADER)
    if value and _REQUEST_ID.fullmatch(value):
        return value
    return None


def parse_networks(text: str) -> tuple[Network, ...]:
    """`10.0.0.5, 192.168.1.0/24, ::1` -> networks (a bare address is a /32 or /128)."""
    items = (item.strip() for item in text.split(","))
    return tuple(ipaddress.ip_network(item, strict=False) for item in items if item)


def _address(text: str) -> Address | None:
    try:
        address = ipaddress.ip_address(text.strip())
    except ValueError:
        return None
    # An IPv4 peer on a dual-stack socket shows up as ::ffff:a.b.c.d.
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        return address.ipv4_mapped
    return address


def _trusted(address: Address, trusted: tuple[Network, ...]) -> bool:
    return any(address.version == n.version and address in n for n in trusted)


def client_address(
    remote_addr: str | None, forwarded_for: str | None, trusted: tuple[Network, ...]
) -> str:
    """The client to name in logs: the peer itself, unless the peer is a trusted proxy.

    Then `X-Forwarded-For` is read from the right (each proxy appends the address it saw):
    trusted hops are skipped, and the first address that is not a trusted proxy is the
    client. Entries to its left were written by that client and prove nothing. A malformed
    entry stops the walk at the last hop that can be vouched for.
    """
    peer = _address(remote_addr or "")
    if peer is None:
        return remote_addr or "-"
    if not forwarded_for or not _trusted(peer, trusted):
        return str(peer)
    client = peer
    for hop in reversed(forwarded_for.split(",")):
        address = _address(hop)
        if address is None:
            break
        client = address
        if not _trusted(address, trusted):
            break
    return str(client)
