"""One SSH connection per host per command: rigctl.connections scopes, rigctl.ssh.session() and on_each_host()."""

from __future__ import annotations

import threading

from rigctl.connections import connections, on_each_host
from rigctl.errors import ConnectError
from rigctl.inventory import Inventory
from rigctl.ssh import SshClient, session


def test_a_scope_hands_out_one_client_per_host(lab_inventory: Inventory) -> None:
    desktop, laptop = lab_inventory.host("desktop"), lab_inventory.host("laptop")
    with connections() as pool:
        with session(desktop) as first, session(desktop) as again, session(laptop) as other:
            assert first is again
            assert other is not first and other.host == "laptop"
        with connections() as inner:  # a scope inside a scope is the same scope
            assert inner is pool
            with session(desktop) as inside:
                assert inside is first
        assert pool.client(desktop, SshClient.for_host) is first


def test_outside_a_scope_each_session_is_its_own(lab_inventory: Inventory, monkeypatch) -> None:
    desktop = lab_inventory.host("desktop")
    given = SshClient.for_host(desktop)
    with session(desktop, given) as ssh:  # a client passed in is used as it is, and left open
        assert ssh is given
    # No rig in the unit tests: record connecting and closing instead of doing them.
    events: list[tuple[str, int]] = []
    monkeypatch.setattr(SshClient, "connect", lambda self: events.append(("connect", id(self))))
    monkeypatch.setattr(SshClient, "close", lambda self: events.append(("close", id(self))))
    with session(desktop) as one:
        pass
    with session(desktop) as two:
        pass
    assert one is not two
    assert events == [("connect", id(one)), ("close", id(one)), ("connect", id(two)), ("close", id(two))]
    events.clear()
    with connections(), session(desktop) as shared:
        assert events == []  # connected on first use, not by the scope
    assert events == [("close", id(shared))]


def test_threads_of_a_command_share_its_scope(lab_inventory: Inventory) -> None:
    hosts = [lab_inventory.host("desktop"), lab_inventory.host("laptop")]
    seen: dict[str, list[int]] = {}
    lock = threading.Lock()

    def work(host) -> str:
        with session(host) as ssh, lock:
            seen.setdefault(host.name, []).append(id(ssh))
        return threading.current_thread().name

    with connections() as pool:
        first = on_each_host(hosts, work)
        second = on_each_host(hosts, work)
        assert list(first) == ["desktop", "laptop"]
        assert all(name.startswith("rigctl-hosts") for name in [*first.values(), *second.values()])
        assert seen["desktop"] == [id(pool.client(hosts[0], SshClient.for_host))] * 2
        assert seen["laptop"] == [id(pool.client(hosts[1], SshClient.for_host))] * 2


def test_one_host_failing_keeps_the_others_results(lab_inventory: Inventory) -> None:
    hosts = [lab_inventory.host("desktop"), lab_inventory.host("laptop")]

    def work(host) -> str:
        if host.name == "desktop":
            raise ConnectError(host.name, "no route to host")
        return "ok"

    outcomes = on_each_host(hosts, work)
    assert isinstance(outcomes["desktop"], ConnectError) and outcomes["laptop"] == "ok"
    assert on_each_host([], work) == {}


def test_a_scope_closes_what_it_opened(lab_inventory: Inventory) -> None:
    desktop = lab_inventory.host("desktop")
    with connections() as pool:
        client = pool.client(desktop, SshClient.for_host)
        closed: list[bool] = []
        client.close = lambda: closed.append(True)  # type: ignore[method-assign]
    assert closed == [True]
    assert pool.client(desktop, SshClient.for_host) is not client  # a closed scope's pool starts over if used again
