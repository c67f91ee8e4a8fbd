"""The one parser of vertex addresses: the host of ``tcp://HOST:PORT`` and the same host on any port."""

from __future__ import annotations

import pytest

from helix.addresses import LOOPBACK, LOOPBACK_HOSTS, any_port, host_of


@pytest.mark.parametrize(("address", "host"), [
    ("tcp://10.0.0.7:5555", "10.0.0.7"),
    ("tcp://gpu-3.example.org:5555", "gpu-3.example.org"),
    ("tcp://127.0.0.1:*", "127.0.0.1"),
    ("tcp://[::1]:5555", "::1"),
    ("tcp://*:5555", "*"),
    ("tcp://10.0.0.7", "10.0.0.7"),
    (None, LOOPBACK),  # a vertex without an address is on loopback
    ("", LOOPBACK),
    ("ipc:///tmp/helix.sock", ""),
])  # fmt: skip
def test_host_of(address: str | None, host: str) -> None:
    assert host_of(address) == host


@pytest.mark.parametrize(("address", "anywhere"), [
    ("tcp://10.0.0.7:5555", "tcp://10.0.0.7:*"),
    ("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"),
    ("tcp://[::1]:5555", "tcp://[::1]:*"),
    ("tcp://[::1]", "tcp://[::1]:*"),
    ("tcp://gpu-3", "tcp://gpu-3:*"),
])  # fmt: skip
def test_any_port_keeps_the_host(address: str, anywhere: str) -> None:
    assert any_port(address) == anywhere
    assert host_of(any_port(address)) == host_of(address)


def test_loopback_names() -> None:
    assert {host_of("tcp://localhost:1"), host_of("tcp://127.0.0.1:1"), host_of("tcp://[::1]:1")} == LOOPBACK_HOSTS
