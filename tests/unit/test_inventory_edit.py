"""The one inventory writer (rigctl/inventory/edit.py) on a copy of the lab inventory: a round trip keeps
every comment and every line it does not change, text from outside is written ``!unsafe``, and an edit whose
result would fail ``inventory check`` (or the caller's own check) is refused with every file byte-identical."""

from __future__ import annotations

from pathlib import Path

import pytest

from rigctl.errors import ConfigError
from rigctl.fleet.models import write_pins
from rigctl.inventory import Inventory
from rigctl.inventory.edit import InventoryEdit, OutsideText

REPO = Path(__file__).resolve().parents[2]
ROLES = [REPO / "roles"]
SHA = "ab" * 32


def files_of(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_round_trip_keeps_comments_order_and_quoting(lab_copy: Path) -> None:
    path = lab_copy / "group_vars" / "all" / "llama_cpp.yml"
    before = path.read_text()
    assert "#" in before  # the file has comments for the round trip to keep
    edit = InventoryEdit(lab_copy, ROLES)
    assert edit.update(path, {"llama_cpp_build_nice": 5})
    assert path.read_text() == before  # staged: nothing lands before commit
    assert edit.commit() == [path]
    after = path.read_text()
    assert after == before + "llama_cpp_build_nice: 5\n"
    assert Inventory.load(lab_copy).host("desktop").vars["llama_cpp_build_nice"] == 5


def test_setting_what_the_file_holds_changes_nothing(lab_copy: Path) -> None:
    path = lab_copy / "host_vars" / "desktop.yml"
    edit = InventoryEdit(lab_copy, ROLES)
    assert not edit.update(path, {"gpu_host_gpu": {"name": "Lab stand-in for RTX 3050 OEM", "vram_mib": 8192,
                                                   "compute_capability": "8.6"}})
    assert edit.commit() == [] and edit.changed == []


def test_outside_text_is_written_unsafe_and_loads_as_the_text_it_is(lab_copy: Path) -> None:
    path = lab_copy / "host_vars" / "desktop.yml"
    text = "reason {{ lookup('pipe', 'id') }}"
    edit = InventoryEdit(lab_copy, ROLES)
    edit.update(path, {"rigctl_allowed_server_flags": {"--props": OutsideText(text)}}, merge=True)
    edit.commit()
    assert "--props: !unsafe 'reason {{ lookup(''pipe'', ''id'') }}'\n" in path.read_text()
    assert Inventory.load(lab_copy).host("desktop").vars["rigctl_allowed_server_flags"] == {"--props": text}


@pytest.mark.parametrize(("key", "value", "needle"), [
    # A misspelt gates key: the gates' schema is part of the inventory's.
    ("rigctl_upgrade_gates", {"speed_marign": 0.9}, "rigctl_upgrade_gates.speed_marign: unknown key"),
    ("llama_server_instances", {"x": {"artifact": "nope", "profile": "lab", "port": 8090}},
     "llama_server_instances.x.artifact: 'nope' is not an artifact in models_catalog"),
    ("llama_cpp_version", "not a label!", "llama_cpp_version"),
])
def test_an_edit_that_would_fail_inventory_check_leaves_every_file_byte_identical(
        lab_copy: Path, key: str, value: object, needle: str) -> None:
    before = files_of(lab_copy)
    edit = InventoryEdit(lab_copy, ROLES, what="the test's edit")
    assert edit.update(lab_copy / "host_vars" / "laptop.yml", {key: value})
    assert edit.delete(lab_copy / "host_vars" / "desktop.yml")
    with pytest.raises(ConfigError, match=r"^the test's edit: refused, nothing written: ") as refused:
        edit.commit()
    assert needle in str(refused.value) and "\n" not in str(refused.value)
    assert str(lab_copy) in str(refused.value) or "host laptop" in str(refused.value)
    assert "rigctl-inventory-edit-" not in str(refused.value)  # it names the inventory, not its staged copy
    assert files_of(lab_copy) == before


def test_the_caller_s_own_check_runs_on_the_edited_inventory_before_anything_lands(lab_copy: Path) -> None:
    before = files_of(lab_copy)
    path = lab_copy / "group_vars" / "all" / "llama_cpp.yml"
    seen: list[int] = []

    def refuse(staged: Inventory) -> None:
        seen.append(staged.host("laptop").vars["llama_cpp_build_nice"])
        raise ConfigError("not today")

    edit = InventoryEdit(lab_copy, ROLES, what="pin")
    edit.update(path, {"llama_cpp_build_nice": 7})
    with pytest.raises(ConfigError, match=r"^pin: refused, nothing written: not today$"):
        edit.commit(verify=refuse)
    assert seen == [7] and files_of(lab_copy) == before


def test_undo_puts_back_what_a_commit_replaced(lab_copy: Path) -> None:
    before = files_of(lab_copy)
    edit = InventoryEdit(lab_copy, ROLES)
    edit.update(lab_copy / "host_vars" / "laptop.yml", {"llama_cpp_build_nice": 3})
    edit.update(lab_copy / "host_vars" / "new.yml", {"x": 1})  # no such host: check refuses the file's name
    with pytest.raises(ConfigError, match=r"file .*host_vars/new\.yml: -: no host 'new'"):
        edit.commit()
    edit = InventoryEdit(lab_copy, ROLES)
    edit.update(lab_copy / "host_vars" / "laptop.yml", {"llama_cpp_build_nice": 3})
    edit.commit()
    assert files_of(lab_copy) != before
    edit.undo()
    assert files_of(lab_copy) == before


def test_a_file_outside_the_inventory_is_refused(lab_copy: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a file of the inventory"):
        InventoryEdit(lab_copy, ROLES).update(tmp_path / "elsewhere.yml", {"a": 1})


def test_models_pins_replace_only_their_block_and_a_bad_pin_writes_nothing(lab_copy: Path) -> None:
    path = lab_copy / "host_vars" / "desktop.yml"
    path.write_text(path.read_text() + "models_pins:\n  smollm2-135m-q4_0: " + "0" * 64 + "\n# kept\nother_key: 1\n")
    before = path.read_text()
    inventory = Inventory.load(lab_copy)
    write_pins(inventory, {"desktop": {"smollm2-135m-q4_1": SHA, "smollm2-135m-q4_0": "1" * 64}})
    after = path.read_text()
    assert after.replace(f"  smollm2-135m-q4_0: '{'1' * 64}'\n  smollm2-135m-q4_1: {SHA}\n", "") == \
        before.replace("  smollm2-135m-q4_0: " + "0" * 64 + "\n", ""), after
    assert Inventory.load(lab_copy).host("desktop").vars["models_pins"] == {
        "smollm2-135m-q4_0": "1" * 64, "smollm2-135m-q4_1": SHA}
    untouched = files_of(lab_copy)
    with pytest.raises(ConfigError, match=r"models pin: refused.*models_pins\.gone: not an artifact in models_catalog"):
        write_pins(inventory, {"desktop": {"smollm2-135m-q4_1": "2" * 64}, "laptop": {"gone": SHA}})
    assert files_of(lab_copy) == untouched
