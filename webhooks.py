"""Webhook addresses and deliveries: where a webhook URL may lead, and one POST there.

A subscription's webhook URL is any URL its creator names, and the server POSTs to
it: without checks, a way to make the server reach what only it can reach (cloud
metadata, loopback services, the private network). So a URL's host is resolved and
every address it names is checked: public addresses may be reached by https, those
in PICOMQ_WEBHOOK_ALLOWED_NETWORKS by http too, nothing else. The check runs when a
subscription is created and again before every delivery attempt, and a delivery
connects only to the addresses just checked, so a DNS answer that changes in between
(DNS rebinding) cannot move it. subscriptions.py decides when to deliver and what.
"""

from __future__ import annotations

import ipaddress
import random
import re
import socket
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

import certifi
import urllib3

from settings import Network

MAX_URL_CHARS = 2048
DELIVERY_TIMEOUT = urllib3.Timeout(connect=3.05, read=10.0)  # seconds, each
MAX_ADDRESSES_TRIED = 4  # of a webhook host's addresses, per delivery attempt
MAX_DELIVERY_ATTEMPTS = 15  # about ten minutes of retries, then the wake is given up
FIRST_RETRY_SECONDS = 1.0
MAX_RETRY_SECONDS = 60.0
RETRY_JITTER = 0.2
MAX_REPLY_BYTES = 64 * 1024

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
NAT64_PREFIX = ipaddress.IPv6Network("64:ff9b::/96")
IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")
# WHATWG URL: a host whose last label is a number is parsed as an IPv4 address, in
# decimal, octal or hex, whole or in parts; resolvers differ on the rarer spellings.
ENDS_IN_A_NUMBER = re.compile(r"(?:^|\.)(?:[0-9]+|0x[0-9a-f]*)\.?$", re.IGNORECASE)


class WebhookUrlRejected(Exception):
    """A webhook URL, or an address its host resolves to, that deliveries may not reach
    (subscriptions.py answers 400 WEBHOOK_URL_REJECTED)."""


class WebhookTimedOut(Exception):
    """A delivery attempt outlived the `webhook_timeout` setting."""


@dataclass(frozen=True)
class WebhookTarget:
    """A webhook URL that passed `check_webhook_url`, with the addresses it was checked at.

    Deliveries connect to these addresses and no others, so a DNS answer that changes
    after the check (DNS rebinding) cannot move them; the URL's host still goes in the
    Host header, in TLS SNI and in the certificate check.
    """

    scheme: str
    host: str  # as the URL spells it, IPv6 without brackets
    port: int | None
    target: str  # the path and query sent in the request line
    addresses: tuple[IPAddress, ...]

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port is None else f"{host}:{self.port}"

    def pool(self, address: IPAddress) -> urllib3.HTTPConnectionPool:
        """A connection pool to `address` alone; proxies from the environment are not used."""
        port = self.port if self.port is not None else 443 if self.scheme == "https" else 80
        if self.scheme == "http":
            return urllib3.HTTPConnectionPool(str(address), port)
        return urllib3.HTTPSConnectionPool(
            str(address), port, cert_reqs="CERT_REQUIRED", ca_certs=certifi.where(),
            server_hostname=self.host,
        )  # fmt: skip


def check_webhook_url(url: str, allowed: tuple[Network, ...]) -> WebhookTarget:
    """Resolve a webhook URL's host once and check every address it names.

    Public addresses may be reached by https; addresses in `allowed` (the setting
    PICOMQ_WEBHOOK_ALLOWED_NETWORKS) by http too. Everything else is refused with
    WebhookUrlRejected: loopback, private, link-local (cloud metadata included), shared,
    reserved and multicast addresses, and IPv6 addresses that embed such an IPv4 one
    (`embedded_ipv4`). A host ending in a number must be four decimal numbers:
    `2130706433`, `0x7f.1` or `0177.0.0.1` are refused, as parsers read them apart.
    """
    parts = parse_webhook_url(url)
    host = parts.hostname or ""
    literal = parse_ip(host)
    if literal is None and ENDS_IN_A_NUMBER.search(host):
        raise WebhookUrlRejected("webhook.url: write an IPv4 host as four decimal numbers")
    addresses = (literal,) if literal is not None else resolve_host(host)
    for address in addresses:
        if any(address in network for network in allowed):
            continue
        if not is_public(address):
            raise WebhookUrlRejected(
                f"webhook.url must not target {host}: a loopback, private or reserved address"
                " needs PICOMQ_WEBHOOK_ALLOWED_NETWORKS"
            )
        if parts.scheme != "https":
            raise WebhookUrlRejected(
                "webhook.url must use https (http only to PICOMQ_WEBHOOK_ALLOWED_NETWORKS)"
            )
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return WebhookTarget(parts.scheme, host, parts.port, target, addresses)


def parse_webhook_url(url: str) -> SplitResult:
    """The parts of an http(s) URL with a host, no credentials and a valid port."""
    if len(url) > MAX_URL_CHARS or not url.isascii() or re.search(r"[\s\\\x00-\x1f\x7f]", url):
        raise WebhookUrlRejected(
            "webhook.url is too long, or holds spaces, control or non-ASCII characters"
        )
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise WebhookUrlRejected("webhook.url must be an http(s) URL with a host")
    if parts.username is not None or parts.password is not None:
        raise WebhookUrlRejected("webhook.url must not carry credentials")
    try:
        port = parts.port
    except ValueError as error:
        raise WebhookUrlRejected("webhook.url has an invalid port") from error
    if port == 0:
        raise WebhookUrlRejected("webhook.url has an invalid port")
    return parts


def parse_ip(text: str) -> IPAddress | None:
    """An IP address literal; an IPv4-mapped IPv6 one (`::ffff:a.b.c.d`) as its IPv4."""
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def resolve_host(host: str) -> tuple[IPAddress, ...]:
    """Every address the resolver gives for `host`, in its order, without repeats."""
    try:
        answers = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as error:
        raise WebhookUrlRejected(f"webhook.url host {host} does not resolve") from error
    parsed = (parse_ip(str(answer[4][0]).split("%", 1)[0]) for answer in answers)
    addresses = tuple(dict.fromkeys(address for address in parsed if address is not None))
    if not addresses:
        raise WebhookUrlRejected(f"webhook.url host {host} does not resolve")
    return addresses


def is_public(address: IPAddress) -> bool:
    """Globally routed unicast by IANA's registries, and so is every IPv4 it embeds."""
    embedded = embedded_ipv4(address)
    if address in NAT64_PREFIX or address in IPV4_COMPATIBLE:
        return all(is_public(inner) for inner in embedded)  # reserved: only a way to these
    site_local = isinstance(address, ipaddress.IPv6Address) and address.is_site_local
    if not address.is_global or address.is_multicast or address.is_reserved or site_local:
        return False
    return all(is_public(inner) for inner in embedded)


def embedded_ipv4(address: IPAddress) -> tuple[ipaddress.IPv4Address, ...]:
    """The IPv4 addresses an IPv6 one carries, where its packets may end up.

    NAT64 (64:ff9b::/96) and IPv4-compatible (::/96) addresses hold one in their last
    32 bits, 6to4 (2002::/16) in bits 16-48, Teredo (2001::/32) a server and a client.
    IPv4-mapped ones (::ffff:0:0/96) are read as IPv4 by `parse_ip` before this.
    """
    if isinstance(address, ipaddress.IPv4Address):
        return ()
    if address in NAT64_PREFIX or address in IPV4_COMPATIBLE:
        return (ipaddress.IPv4Address(int(address) & 0xFFFF_FFFF),)
    if address.sixtofour is not None:
        return (address.sixtofour,)
    return address.teredo or ()


def post_webhook(target: WebhookTarget, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    """POST to the first checked address that takes a connection: its status and reply.

    Up to MAX_ADDRESSES_TRIED addresses are tried, in the resolver's order; only a
    failed connection moves on to the next, so a receiver gets the body at most once.
    The reply is read only when 2xx, and at most MAX_REPLY_BYTES of it. Redirects are
    not followed (a 3xx is a failed delivery). Raises urllib3's HTTPError or OSError.
    """
    addresses = target.addresses[:MAX_ADDRESSES_TRIED]
    for address in addresses[:-1]:
        try:
            return post_to_address(target, address, body, headers)
        except urllib3.exceptions.ConnectTimeoutError:  # NewConnectionError included
            continue
    return post_to_address(target, addresses[-1], body, headers)


def post_to_address(
    target: WebhookTarget, address: IPAddress, body: bytes, headers: dict[str, str]
) -> tuple[int, bytes]:
    with target.pool(address) as pool:
        response = pool.urlopen(
            "POST", target.target, body=body, headers={**headers, "Host": target.host_header},
            redirect=False, retries=False, timeout=DELIVERY_TIMEOUT, preload_content=False,
        )  # fmt: skip
        try:
            if not 200 <= response.status < 300:
                return response.status, b""
            return response.status, response.read(MAX_REPLY_BYTES, decode_content=True)
        finally:
            response.release_conn()


def retry_delay(attempt: int) -> float:
    """Seconds before retry `attempt` (0-based): 1, 2, 4 … capped at 60, each ±20 %."""
    base = min(FIRST_RETRY_SECONDS * 2**attempt, MAX_RETRY_SECONDS)
    return base * random.uniform(1 - RETRY_JITTER, 1 + RETRY_JITTER)
