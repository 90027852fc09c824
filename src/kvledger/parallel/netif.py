"""Which network interface a rank's collectives use.

Gloo picks its interface from the machine's host name unless ``GLOO_SOCKET_IFNAME`` names one, and
on many machines the host name resolves to a loopback address (Debian's ``127.0.1.1``): a rank on
another machine is then told to connect to 127.0.0.1 and the group never forms (seen with two
network namespaces, tests/integration/test_two_hosts.py). The interface that routes to the
rendezvous address (``--dist-init-addr``) is the one the other ranks can reach, so that is the one
used, unless the user chose. It is also the only one gloo listens on (its pairs' sockets are bound
to that interface's address: 127.0.0.1 on one machine), never every interface.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import struct

log = logging.getLogger("kvledger.parallel")

SIOCGIFADDR = 0x8915


def local_address_towards(host: str, port: int) -> str | None:
    """This machine's address on the route to ``host`` (no packet is sent: a UDP socket's connect
    only picks the route)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return None


def interface_of(address: str) -> str | None:
    """The name of the interface holding the IPv4 ``address``, or None."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            try:
                got = fcntl.ioctl(s.fileno(), SIOCGIFADDR, req)
            except OSError:
                continue  # no IPv4 address on this one
            if socket.inet_ntoa(got[20:24]) == address:
                return name
    return None


@contextlib.contextmanager
def gloo_interface(rendezvous: str):
    """``GLOO_SOCKET_IFNAME`` set to the interface that reaches ``rendezvous`` (``host:port``) while
    the group forms, unless the user set it; the environment is restored after, so a process that
    joins a group (a test, an engine in-process) does not hand its choice to the processes it starts
    later (another machine's namespace, another group)."""
    before = os.environ.get("GLOO_SOCKET_IFNAME")
    name = choose_gloo_interface(rendezvous)
    try:
        yield name
    finally:
        if before is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = before


def choose_gloo_interface(rendezvous: str) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` to the interface that reaches ``rendezvous`` (``host:port``) unless
    it is set already; returns the interface used (None: left to gloo)."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return os.environ["GLOO_SOCKET_IFNAME"]
    host, _, port = rendezvous.rpartition(":")
    local = local_address_towards(host.strip("[]"), int(port or 0) or 1)
    name = interface_of(local) if local else None
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name
        log.info("tensor parallel collectives over %s (%s), the route to %s", name, local, rendezvous)
    return name
