"""The inventory loaded in a forked child (rigctl.inventory.preload): the same inventory, the same errors
and log lines as a plain load, and no child left behind. Each case runs in a fresh interpreter: a test
worker has threads, and a process with threads loads in-process instead of forking."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    import os

    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env={**os.environ, **env}, check=False)
    assert done.returncode == 0, done.stderr
    return done


def test_a_preloaded_inventory_is_the_plain_one_and_ansible_stays_in_the_child() -> None:
    out = _python("""
        import json, os, sys
        from rigctl.inventory.preload import InventoryPreload
        preload = InventoryPreload("inventory/lab")
        forked = preload._pid is not None
        inventory = preload.result()
        ansible_here = sorted(m for m in sys.modules if m == "ansible" or m.startswith("ansible."))
        from rigctl.inventory import Inventory
        plain = Inventory.load("inventory/lab")
        same = (inventory.source == plain.source and inventory.hosts == plain.hosts
                and inventory.own_vars == plain.own_vars and inventory.group_parents == plain.group_parents)
        print(json.dumps({"forked": forked, "ansible_here": ansible_here, "same": same,
                          "hosts": sorted(inventory.hosts)}))
    """, RIGCTL_LAB_SLOT="3")
    answer = json.loads(out.stdout)
    assert answer == {"forked": True, "ansible_here": [], "same": True, "hosts": ["desktop", "laptop"]}


def test_a_vault_value_comes_back_decrypted_over_the_pipe(tmp_path: Path) -> None:
    from test_inventory import _vault_inventory

    inv = _vault_inventory(tmp_path, "correct horse")
    (tmp_path / "vault-pass").write_text("correct horse\n")
    out = _python(f"""
        from rigctl.inventory.preload import InventoryPreload
        preload = InventoryPreload({str(inv)!r})
        assert preload._pid is not None
        print(preload.result().host("rig").vars["models_hf_token"])
    """, ANSIBLE_VAULT_PASSWORD_FILE=str(tmp_path / "vault-pass"), RIGCTL_CACHE_DIR=str(tmp_path / "cache"))
    assert out.stdout == "hf_secret_token\n"
    # Memory only: no file the load wrote (the cache included) holds the decrypted value.
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.parent.name == "ansible-routing" for p in written)
    assert not [p for p in written if b"hf_secret_token" in p.read_bytes()]


@pytest.mark.parametrize("make", ["missing", "bad_yaml"])
def test_a_bad_inventory_preloaded_fails_as_a_plain_load_does(tmp_path: Path, make: str) -> None:
    inv = tmp_path / "inv"
    if make == "bad_yaml":
        inv.mkdir()
        (inv / "hosts.yml").write_text("all:\n  hosts:\n    rig: [unclosed\n")
    out = _python(f"""
        from rigctl.errors import ConfigError
        from rigctl.inventory import Inventory
        from rigctl.inventory.preload import InventoryPreload
        def error(load):
            try:
                load()
            except ConfigError as exc:
                return str(exc)
            return None
        preload = InventoryPreload({str(inv)!r})
        print(error(preload.result))
        print(error(lambda: Inventory.load({str(inv)!r})))
    """)
    preloaded, plain = out.stdout.splitlines()
    assert preloaded == plain and str(inv) in plain


def test_the_childs_warnings_are_logged_here(tmp_path: Path) -> None:
    inv = tmp_path / "inv"
    inv.mkdir()
    # A group and a host of one name: Ansible warns, and the load logs it.
    (inv / "hosts.yml").write_text("all:\n  children:\n    rig:\n      hosts:\n        rig:\n"
                                   "          ansible_host: 127.0.0.1\n")
    code = f"""
        import logging
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
        from rigctl.inventory import Inventory
        from rigctl.inventory.preload import InventoryPreload
        if {{mode!r}} == "preload":
            preload = InventoryPreload({str(inv)!r})
            assert preload._pid is not None
            preload.result()
        else:
            Inventory.load({str(inv)!r})
    """
    preloaded = _python(code.format(mode="preload")).stderr
    plain = _python(code.format(mode="plain")).stderr
    assert "WARNING rigctl.inventory.model inventory" in plain
    assert preloaded == plain


def test_close_reaps_the_child_and_threads_mean_no_fork() -> None:
    out = _python("""
        import json, os, threading
        from rigctl.inventory.preload import InventoryPreload
        preload = InventoryPreload("inventory/lab")
        pid = preload._pid
        preload.close()
        try:
            os.waitpid(pid, os.WNOHANG)
            reaped = False
        except ChildProcessError:
            reaped = True
        stop = threading.Event()
        worker = threading.Thread(target=stop.wait)
        worker.start()
        threaded = InventoryPreload("inventory/lab")
        print(json.dumps({"reaped": reaped, "forked_with_threads": threaded._pid is not None,
                          "hosts": sorted(threaded.result().hosts)}))
        stop.set()
        worker.join()
    """, RIGCTL_LAB_SLOT="3")
    assert json.loads(out.stdout) == {"reaped": True, "forked_with_threads": False, "hosts": ["desktop", "laptop"]}


@pytest.mark.parametrize(("argv", "hosts"), [
    (["-vv", "bench", "run"], "desktop, laptop"),  # $RIGCTL_INVENTORY's, loaded before the arguments are parsed
    (["-vv", "-i", "inventory/rigs", "bench", "run"], "desktop-3050, laptop-1650ti"),  # -i's, once parsed
    (["-vv", "--inventory=inventory/rigs", "bench", "load"], "desktop-3050, laptop-1650ti"),
])
def test_bench_commands_load_the_inventory_they_name_in_a_child(argv: list[str], hosts: str) -> None:
    import os

    rest = ["-H", "nohost", "-m", "x"] if argv[-1] == "run" else ["nohost", "x"]
    done = subprocess.run([sys.executable, "-m", "rigctl.cli", *argv, *rest], capture_output=True, text=True,
                          timeout=120, cwd=REPO, check=False,
                          env={**os.environ, "RIGCTL_INVENTORY": "inventory/lab", "RIGCTL_LAB_SLOT": "3"})
    assert done.returncode == 2, done.stderr
    assert f"(hosts: {hosts})" in done.stderr.splitlines()[-1]
    assert "loaded by child" in done.stderr


def test_a_child_is_started_only_for_a_command_that_reads_the_inventory(tmp_path: Path) -> None:
    def rigctl(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "rigctl.cli", "-vv", *args], capture_output=True, text=True,
                              timeout=120, cwd=REPO, check=False, env={"PATH": "/usr/bin:/bin",
                                                                       "RIGCTL_INVENTORY": "inventory/lab"})
        assert done.returncode != 0 and "error: " in done.stderr
        return done.stderr

    summary = rigctl("bench", "summary", "--results", str(tmp_path), "nothing")
    assert "by child" not in summary and "stopping child" not in summary
    # One that never gets as far as loading it (a usage error) stops its child.
    assert "not needed; stopping child" in rigctl("bench", "run", "--rounds", "many")


def test_ansibles_routing_table_is_parsed_once_then_read_from_the_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    code = """
        import json
        from ansible.utils.collection_loader import _collection_finder
        parse, calls = _collection_finder._meta_yml_to_dict, []
        def counted(data, content_id):
            calls.append(content_id)
            return parse(data, content_id)
        _collection_finder._meta_yml_to_dict = counted
        from rigctl.inventory import Inventory
        Inventory.load("inventory/lab")
        print(json.dumps(calls))
    """
    assert json.loads(_python(code, RIGCTL_CACHE_DIR=str(cache), RIGCTL_LAB_SLOT="3").stdout) \
        == [["ansible.builtin", "runtime.yml"]]
    (table,) = (cache / "ansible-routing").iterdir()
    import ansible
    from ansible.utils.collection_loader._collection_meta import _meta_yml_to_dict

    runtime = Path(ansible.__file__).parent / "config" / "ansible_builtin_runtime.yml"
    assert json.loads(table.read_text()) == _meta_yml_to_dict(runtime.read_bytes(), None)
    assert json.loads(_python(code, RIGCTL_CACHE_DIR=str(cache), RIGCTL_LAB_SLOT="3").stdout) == []
    table.write_text('{"cut short')  # a damaged cache is parsed again and rewritten
    assert len(json.loads(_python(code, RIGCTL_CACHE_DIR=str(cache), RIGCTL_LAB_SLOT="3").stdout)) == 1
    assert json.loads(table.read_text()) == _meta_yml_to_dict(runtime.read_bytes(), None)
