"""The test harnesses' port picker: picks made before any is bound never collide (a CI run once got the
same port for nginx's http and https listeners)."""

from __future__ import annotations

import socket

from tests import helpers


def test_many_picks_in_a_row_are_all_different_and_free():
    # The kernel alone repeats a just-closed port about once in 100 picks here, so 400 picks catch it.
    ports = [helpers.free_port() for _ in range(400)]
    assert len(set(ports)) == len(ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))


def test_a_port_the_kernel_hands_out_again_is_skipped(monkeypatch):
    given = iter([41001, 41001, 41001, 41002])

    class Kernel:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            self.port = next(given)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(helpers.socket, "socket", Kernel)
    monkeypatch.setattr(helpers, "_PORTS_GIVEN", set())
    assert [helpers.free_port(), helpers.free_port()] == [41001, 41002]
