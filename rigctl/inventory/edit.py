"""The one writer of the inventory's files: every change rigctl makes to an inventory (a host enrolled or
removed, its probed facts, an upgrade's pin and the advisories it accepts, the models' sha256 pins) is an
:class:`InventoryEdit`.

- **Round trip** (ruamel.yaml): the comments, order and quoting of what the edit does not change stay as
  they were.
- **Data, never code**: text from outside the inventory (:class:`OutsideText`: what a host reported, a reason
  given on the command line) is written ``!unsafe``, so no later inventory load or play templates it.
- **Checked before it lands**: :meth:`InventoryEdit.commit` lays the edited files over a copy of the
  inventory, which must load and pass ``inventory check`` (and the caller's own ``verify``); only then does
  each file land, by an atomic rename. A refused edit leaves every file as it was, byte for byte.
"""

from __future__ import annotations

import io
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, TaggedScalar

from rigctl.errors import ConfigError
from rigctl.files import write_atomically

if TYPE_CHECKING:
    from rigctl.inventory.model import Inventory

#: Ansible's tag for a string it must never template.
UNSAFE_TAG = "!unsafe"
#: The folders of variables Ansible reads beside an inventory file.
VARS_DIRS = ("host_vars", "group_vars")


class OutsideText(str):
    """Text from outside the inventory (a host's, a command line's): the files keep it ``!unsafe``. Values a
    pattern already confines (versions, sha256s) stay plain ``str``: Ansible reads an ``!unsafe`` scalar as
    YAML would read it unquoted, so ``!unsafe '8.6'`` would load as a float."""


def round_trip_yaml() -> YAML:
    yaml = YAML()  # round trip: comments, order and quoting stay as they were
    yaml.indent(mapping=2, sequence=4, offset=2)
    yaml.width = 120
    yaml.preserve_quotes = True
    return yaml


def vars_file(inventory: Inventory, origin: str, key: str) -> Path:
    """The group_vars/host_vars file that defines ``key`` for ``origin`` (``group all``, ``host desktop``)."""
    kind, _, name = origin.partition(" ")
    root = Path(inventory.source)
    folder = root / ("group_vars" if kind == "group" else "host_vars")
    candidates = [folder / f"{name}.yml", folder / f"{name}.yaml",
                  *sorted((folder / name).glob("*.yml")), *sorted((folder / name).glob("*.yaml"))]
    for path in candidates:
        if path.is_file():
            data = round_trip_yaml().load(path.read_text())
            if isinstance(data, dict) and key in data:
                return path
    raise ConfigError(f"{origin}: {key} is not defined in a file under {folder} that rigctl can edit "
                      f"(an inventory file's inline variables are not)")


def yaml_value(value: Any) -> Any:
    """``value`` as the file keeps it: each :class:`OutsideText` an ``!unsafe`` scalar (quoted for the reader;
    Ansible resolves it as if unquoted, which free text survives as a string)."""
    if isinstance(value, OutsideText):
        return TaggedScalar(str(value), style="'", tag=UNSAFE_TAG)
    if isinstance(value, Mapping):
        return {k: yaml_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [yaml_value(v) for v in value]
    return value


def comparable(value: Any) -> Any:
    """A value of the file or of the caller as plain Python, a string with its ``!unsafe`` tag kept: outside
    text the file holds without the tag (written before it was tagged) differs, so it is rewritten tagged."""
    if isinstance(value, TaggedScalar):
        return (str(value.tag), str(value.value))
    if isinstance(value, OutsideText):
        return (UNSAFE_TAG, str(value))
    if isinstance(value, Mapping):
        return {str(k): comparable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [comparable(v) for v in value]
    if isinstance(value, str):
        return str(value)
    return value


def _set_in_place(there: CommentedMap, value: Mapping[str, Any], *, merge: bool) -> None:
    """The mapping ``there`` made to hold ``value``'s keys (with ``merge``, its other keys too), each key it
    keeps with its comments. ruamel hangs the comment lines after a mapping on its last key: they move to
    whichever key is last now, so they stay where they stood in the file."""
    last = next(reversed(there), None)
    trailing = there.ca.items.pop(last, None) if last is not None else None
    for gone in [k for k in there if k not in value and not merge]:
        del there[gone]
    for inner, setting in value.items():
        if comparable(there.get(inner)) != comparable(setting):
            there[inner] = yaml_value(setting)
    if trailing is not None and there:
        there.ca.items[next(reversed(there))] = trailing


class InventoryEdit:
    """Changes to the files of the inventory ``source`` (its directory, or its hosts file with the
    ``host_vars``/``group_vars`` beside it), staged until :meth:`commit`. ``roles_paths``: the roles whose
    defaults ``inventory check`` knows as variables. ``what`` names the edit in a refusal."""

    def __init__(self, source: str | os.PathLike[str], roles_paths: Iterable[Path], *, what: str = "the edit"):
        self.source = Path(source)
        self.root = self.source if self.source.is_dir() else self.source.parent
        self.roles_paths = list(roles_paths)
        self.what = what
        self._staged: dict[Path, str | None] = {}  # path -> its new text, None to delete it
        self._before: dict[Path, bytes | None] = {}  # what commit replaced, for undo

    # ---------------------------------------------------------------- staging

    def read(self, path: Path) -> Any:
        """``path``'s document (round trip) as the edit leaves it so far; None when there is none."""
        text = self._staged[path] if path in self._staged else path.read_text() if path.is_file() else None
        if text is None:
            return None
        try:
            return round_trip_yaml().load(text)
        except Exception as exc:  # ruamel's errors have no common base worth naming
            raise ConfigError(f"{path}: not YAML rigctl can edit: {str(exc).splitlines()[0]}") from None

    def write(self, path: Path, data: Any) -> bool:
        """Stage ``data`` as ``path``'s document; False when that is the text the file holds already."""
        self._inside(path)
        buffer = io.StringIO()
        round_trip_yaml().dump(data, buffer)
        text = buffer.getvalue()
        on_disk = path.read_text() if path.is_file() else None
        if text == on_disk:
            self._staged.pop(path, None)
            return False
        self._staged[path] = text
        return True

    def update(self, path: Path, values: Mapping[str, Any], *, merge: bool = False, header: str | None = None) -> bool:
        """Set ``values`` (top-level keys) in ``path``, made (with ``header`` as its first comment) when missing,
        keeping its other keys and comments; with ``merge``, a mapping value is set key by key into the mapping
        there. A value the file holds already, tagged alike, is left as it is. False when nothing changes."""
        data = self.read(path)
        if data is None:
            data = CommentedMap()
            if header:
                data.yaml_set_start_comment(header)
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of variables")
        for key, value in values.items():
            there = data.get(key)
            if isinstance(value, Mapping) and isinstance(there, CommentedMap):
                _set_in_place(there, value, merge=merge)
            elif comparable(there) != comparable(value):
                data[key] = yaml_value(value)
        return self.write(path, data)

    def delete(self, path: Path) -> bool:
        """Stage ``path``'s removal; False when there is no such file."""
        self._inside(path)
        if not path.is_file():
            self._staged.pop(path, None)
            return False
        self._staged[path] = None
        return True

    @property
    def changed(self) -> list[Path]:
        """The files the edit changes (before :meth:`commit`) or changed (after)."""
        return list(self._staged or self._before)

    def _inside(self, path: Path) -> None:
        if not path.resolve().is_relative_to(self.root.resolve()):
            raise ConfigError(f"{path}: not a file of the inventory {self.source}")

    # ---------------------------------------------------------------- landing

    def commit(self, verify: Callable[[Inventory], None] | None = None) -> list[Path]:
        """Check the inventory as the edit leaves it, then land every staged file; the files changed.
        ConfigError (one line, naming the edit and the first problem) when the result does not load, fails
        ``inventory check``, or fails ``verify`` (given the staged inventory): then no file is touched."""
        if not self._staged:
            return []
        with tempfile.TemporaryDirectory(prefix="rigctl-inventory-edit-") as tmp:
            staged_source = self._stage(Path(tmp) / "inventory")
            self._check(staged_source, Path(tmp) / "inventory", verify)
        self._land()
        return self.changed

    def undo(self) -> None:
        """Put back what :meth:`commit` replaced, as it was (a later step of the caller failed)."""
        for path, data in self._before.items():
            if data is None:
                path.unlink(missing_ok=True)
            else:
                write_atomically(path, data, stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o644)
        self._before.clear()

    def _stage(self, copy: Path) -> Path:
        """A copy of the inventory at ``copy`` with the edit applied; the source to load there."""
        hidden = shutil.ignore_patterns(".*")
        if self.source.is_dir():
            shutil.copytree(self.root, copy, ignore=hidden)
        else:
            copy.mkdir()
            shutil.copy2(self.source, copy / self.source.name)
            for folder in VARS_DIRS:
                if (self.root / folder).is_dir():
                    shutil.copytree(self.root / folder, copy / folder, ignore=hidden)
        for path, text in self._staged.items():
            target = copy / path.resolve().relative_to(self.root.resolve())
            if text is None:
                target.unlink(missing_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text)
        return copy if self.source.is_dir() else copy / self.source.name

    def _check(self, staged_source: Path, copy: Path, verify: Callable[[Inventory], None] | None) -> None:
        from rigctl.inventory.check import check
        from rigctl.inventory.model import Inventory

        def here(message: str) -> str:  # problems name the inventory's own files, not the copy's
            return message.replace(str(copy), str(self.root))

        refused = f"{self.what}: refused, nothing written"
        try:
            inventory = Inventory.load(staged_source)
            # What the inventory got wrong before the edit is its own (`inventory check` and provision refuse it);
            # the edit is refused for what it would add.
            before = self._errors_before()
            errors = [p for p in check(inventory, self.roles_paths)
                      if p.severity == "error" and here(str(p)) not in before]
            if errors:
                more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
                raise ConfigError(f"the inventory would fail `inventory check`: {errors[0]}{more}")
            if verify is not None:
                verify(inventory)
        except ConfigError as exc:
            raise ConfigError(here(f"{refused}: {exc}")) from None

    def _errors_before(self) -> set[str]:
        from rigctl.inventory.check import check
        from rigctl.inventory.model import Inventory

        try:
            inventory = Inventory.load(self.source)
        except ConfigError:
            return set()
        return {str(p) for p in check(inventory, self.roles_paths) if p.severity == "error"}

    def _land(self) -> None:
        try:
            for path, text in self._staged.items():
                self._before[path] = path.read_bytes() if path.is_file() else None
                if text is None:
                    path.unlink(missing_ok=True)
                else:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    write_atomically(path, text, stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o644)
        except BaseException:
            self.undo()
            raise
        self._staged.clear()
