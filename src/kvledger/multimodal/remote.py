"""Remote ``http(s)`` image URLs, fetched only when the operator allows it (``--allow-remote-media``;
off by default, as a server should not fetch what a client names from its own network), and then
within limits: ``http``/``https`` only, hosts under ``--allowed-media-domains`` when given (vLLM's
flag), the body read as a stream and cut at ``--max-image-bytes``, one deadline for the whole fetch
(``--media-fetch-timeout-s``: resolving, connecting, every redirect and every byte), at most
``--media-max-redirects`` redirects, each hop checked like the first.

No private address is ever reached (server-side request forgery): each hop's host is resolved here,
EVERY address it resolves to is checked with ``ipaddress`` (private, loopback, link-local, reserved,
multicast, unspecified, shared, IPv4-mapped forms of those: refused), and the connection goes to the
checked address itself (the URL's host replaced by it; ``Host`` and TLS SNI/certificate checked
against the name), so a second DNS answer (a rebind) cannot swap it. The environment's proxies are
ignored (``trust_env=False``) for the same reason.

The fetch is asynchronous (resolution in the loop's executor, the body over httpx's async client), so
the front keeps serving while a slow host answers. Every refusal is a 400 naming the part, before the
request exists."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import httpx

from ..errors import ValidationError

if TYPE_CHECKING:
    from .media import MediaLimits

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
# An address policy: why an address may not be fetched from, or None when it may.
AddressPolicy = Callable[[Address], "str | None"]
# A resolver: a host name's addresses (as strings), for a port.
Resolver = Callable[[str, int], Awaitable[list[str]]]

REDIRECTS = (301, 302, 303, 307, 308)


def public_only(addr: Address) -> str | None:
    """The default policy: only globally routable unicast addresses."""
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    for what in ("loopback", "private", "link_local", "multicast", "unspecified", "reserved"):
        if getattr(addr, f"is_{what}"):
            return what.replace("_", "-")
    if not addr.is_global:  # shared (100.64/10), documentation, 6to4/Teredo of non-global, ...
        return "not global"
    return None


async def system_resolve(host: str, port: int) -> list[str]:
    """The host's addresses from the system resolver, off the event loop (the loop's executor)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


def domain_allowed(host: str, domains: tuple[str, ...] | None) -> bool:
    """``host`` is one of ``domains`` or a subdomain of one (any host when ``domains`` is None)."""
    if domains is None:
        return True
    host = host.lower().rstrip(".")
    return any(host == d or host.endswith("." + d) for d in (d.lower().rstrip(".") for d in domains))


class RemoteFetcher:
    """Fetches remote image URLs within ``limits``; ``policy`` and ``resolve`` are injectable (a
    unit test lets 127.0.0.1 through to test the limits against its own server; nothing else does)."""

    def __init__(self, limits: MediaLimits, policy: AddressPolicy = public_only, resolve: Resolver = system_resolve):
        self.limits = limits
        self.policy = policy
        self.resolve = resolve

    async def fetch(self, url: str, param: str) -> bytes:
        """The body ``url`` names (after redirects), or a 400 naming ``param``."""
        lim = self.limits
        if not lim.allow_remote_media:
            raise ValidationError("remote image URLs are off on this server (--allow-remote-media)", param=param)
        try:
            return await asyncio.wait_for(self._fetch(url, param), lim.media_fetch_timeout_s)
        except asyncio.TimeoutError:
            raise ValidationError(
                f"image fetch took longer than {lim.media_fetch_timeout_s} s (--media-fetch-timeout-s)", param=param
            ) from None

    async def fetch_all(self, urls: list[tuple[str, str]]) -> dict[str, bytes]:
        """Each distinct URL of ``(url, param)`` fetched, concurrently; the first refusal cancels the rest."""
        first: dict[str, str] = {}
        for url, param in urls:
            first.setdefault(url, param)
        if not first:
            return {}
        tasks = {url: asyncio.ensure_future(self.fetch(url, param)) for url, param in first.items()}
        try:
            await asyncio.gather(*tasks.values())  # the first refusal raised as it is (a 400 naming its part)
        finally:
            for t in tasks.values():
                t.cancel()  # the others, after a refusal
        return {url: t.result() for url, t in tasks.items()}

    async def _fetch(self, url: str, param: str) -> bytes:
        lim = self.limits
        try:
            target = httpx.URL(url)
        except (httpx.InvalidURL, TypeError):
            raise ValidationError("malformed image URL", param=param) from None
        async with httpx.AsyncClient(follow_redirects=False, trust_env=False, timeout=lim.media_fetch_timeout_s) as client:
            for _ in range(lim.media_max_redirects + 1):
                addr = await self._checked_address(target, param)
                pinned = target.copy_with(host=addr)
                # identity: the body is read raw, so a compressed body is never inflated past the cap
                headers = {"Host": target.netloc.decode("ascii"), "Accept": "image/*", "Accept-Encoding": "identity"}
                ext = {"sni_hostname": target.host} if target.scheme == "https" else {}
                try:
                    async with client.stream("GET", pinned, headers=headers, extensions=ext) as r:
                        if r.status_code in REDIRECTS and "location" in r.headers:
                            try:
                                target = target.join(r.headers["location"])
                            except httpx.InvalidURL:
                                raise ValidationError("image URL redirected to a malformed URL", param=param) from None
                            continue
                        if r.status_code != 200:
                            raise ValidationError(f"image URL answered HTTP {r.status_code}", param=param)
                        return await self._body(r, param)
                except httpx.HTTPError as e:
                    raise ValidationError(f"image fetch failed ({type(e).__name__})", param=param) from None
        raise ValidationError(
            f"image URL redirected more than {lim.media_max_redirects} times (--media-max-redirects)", param=param
        )

    async def _checked_address(self, url: httpx.URL, param: str) -> str:
        """The address to connect to for ``url``: every address its host resolves to must pass the
        policy (one bad address refuses the host: a resolver may answer either next time)."""
        if url.scheme not in ("http", "https"):
            raise ValidationError("only http and https image URLs are fetched", param=param)
        if not url.host:
            raise ValidationError("image URL without a host", param=param)
        if url.userinfo:
            raise ValidationError("image URLs with credentials are not fetched", param=param)
        if not domain_allowed(url.host, self.limits.allowed_media_domains):
            raise ValidationError(f"image host {url.host} is not under --allowed-media-domains", param=param)
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            addrs = [ipaddress.ip_address(url.host)]
        except ValueError:
            try:
                addrs = [ipaddress.ip_address(a.split("%")[0]) for a in await self.resolve(url.host, port)]
            except (OSError, UnicodeError, ValueError):
                raise ValidationError(f"image host {url.host} does not resolve", param=param) from None
        if not addrs:
            raise ValidationError(f"image host {url.host} does not resolve", param=param)
        for a in addrs:
            why = self.policy(a)
            if why is not None:
                raise ValidationError(f"image host {url.host} resolves to a {why} address ({a}): refused", param=param)
        return str(addrs[0])

    async def _body(self, r: httpx.Response, param: str) -> bytes:
        """The body read as a stream, stopped as soon as it passes the byte cap."""
        cap = self.limits.max_image_bytes
        declared = r.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cap:
            raise ValidationError(f"image larger than {cap} bytes", param=param)
        buf = bytearray()
        async for chunk in r.aiter_raw():
            buf += chunk
            if len(buf) > cap:
                raise ValidationError(f"image larger than {cap} bytes", param=param)
        return bytes(buf)
