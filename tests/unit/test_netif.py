"""The interface a rank's collectives use: the route to the rendezvous, unless the user chose."""

from __future__ import annotations

from kvledger.parallel.netif import choose_gloo_interface, interface_of, local_address_towards


def test_the_route_to_loopback_is_lo(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")  # unset for the function; restored after the test
    assert local_address_towards("127.0.0.1", 29500) == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo"
    assert choose_gloo_interface("127.0.0.1:29500") == "lo"
    import os

    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"


def test_the_users_choice_wins(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    assert choose_gloo_interface("127.0.0.1:29500") == "eth7"


def test_an_address_no_interface_holds_is_none():
    assert interface_of("192.0.2.77") is None  # TEST-NET-1: never configured here


def test_the_choice_lasts_only_while_the_group_forms(monkeypatch):
    """An engine joining a group in this process must not hand its interface to processes started
    later (the full suite ran an in-process TP engine, then a server in another namespace inherited
    GLOO_SOCKET_IFNAME=lo and never reached its other node)."""
    import os

    from kvledger.parallel.netif import gloo_interface

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    with gloo_interface("127.0.0.1:29500") as name:
        assert name == "lo" and os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    with gloo_interface("127.0.0.1:29500") as name:
        assert name == "eth7"
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
