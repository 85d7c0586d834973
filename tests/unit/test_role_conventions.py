"""The roles' shared conventions, read from their files:

* every role's ``meta/argument_specs.yml`` states the defaults its ``defaults/main.yml`` sets: the same
  variables, each with the same default (ansible-doc and the argument validation show the spec's; the role
  runs with the file's), so a spec that lies fails here;
* one phase-tag scheme: each phase ``tasks/main.yml`` imports is tagged ``<role>_<phase>`` and the preflight
  carries every phase's tag (a phase run alone is still checked first);
* every systemd unit a role writes is verified by ``systemd-analyze verify`` before it lands, and a change
  restarts it through a handler that ``listen``s;
* a README per role."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROLES = Path(__file__).resolve().parents[2] / "roles"
ALL_ROLES = sorted(p for p in ROLES.iterdir() if (p / "tasks" / "main.yml").is_file())


def spec_options(role: Path) -> dict[str, dict]:
    """Every option of every entry point of ``role``'s argument spec (an option named by several entry
    points must say the same default in each)."""
    specs = yaml.safe_load((role / "meta" / "argument_specs.yml").read_text())["argument_specs"]
    options: dict[str, dict] = {}
    for entry_point, body in specs.items():
        for name, option in (body.get("options") or {}).items():
            if name in options:
                assert options[name].get("default") == option.get("default"), (
                    f"{role.name}: {name}'s default differs between entry points ({entry_point})")
            options[name] = option
    return options


@pytest.mark.parametrize("role", sorted(p for p in ROLES.iterdir() if (p / "defaults" / "main.yml").is_file()),
                         ids=lambda p: p.name)
def test_argument_spec_defaults_equal_the_role_s_defaults(role: Path) -> None:
    defaults = yaml.safe_load((role / "defaults" / "main.yml").read_text()) or {}
    options = spec_options(role)
    public = {name: value for name, value in defaults.items() if not name.startswith("_")}
    assert sorted(set(public) - set(options)) == [], f"{role.name}: defaults the argument spec does not name"
    differing = {name: (options[name].get("default", "<no default>"), value) for name, value in public.items()
                 if options[name].get("default", "<no default>") != value}
    assert differing == {}, f"{role.name}: spec default != defaults/main.yml: {differing}"
    stated = {name for name, option in options.items() if "default" in option}
    assert sorted(stated - set(public)) == [], f"{role.name}: spec defaults that defaults/main.yml does not set"


def phase_imports(role: Path) -> dict[str, list[str]]:
    """``{phase file stem: its tags}`` of the phases ``tasks/main.yml`` imports."""
    tasks = yaml.safe_load((role / "tasks" / "main.yml").read_text()) or []
    return {Path(task["ansible.builtin.import_tasks"]["file"]).stem: list(task.get("tags") or [])
            for task in tasks if "ansible.builtin.import_tasks" in task}


@pytest.mark.parametrize("role", [r for r in ALL_ROLES if phase_imports(r)], ids=lambda p: p.name)
def test_one_phase_tag_scheme(role: Path) -> None:
    phases = phase_imports(role)
    assert next(iter(phases)) == "preflight", f"{role.name}: the phases start with the preflight"
    untagged = [phase for phase, tags in phases.items() if not tags]
    assert untagged == [], f"{role.name}: phases without a tag"
    foreign = sorted({tag for tags in phases.values() for tag in tags if not tag.startswith(f"{role.name}_")})
    assert foreign == [], f"{role.name}: phase tags not named <role>_<phase>"
    later = {tag for phase, tags in phases.items() if phase != "preflight" for tag in tags}
    assert sorted(later - set(phases["preflight"])) == [], f"{role.name}: phases the preflight does not run for"


def unit_templates(role: Path) -> list[tuple[Path, dict]]:
    """Every task of ``role`` that writes a systemd unit from a template, with its file."""
    def walk(tasks: list | None) -> list[dict]:
        out = []
        for task in tasks or []:
            out.extend(walk(task.get("block")))
            template = task.get("ansible.builtin.template")
            if isinstance(template, dict) and str(template.get("dest", "")).endswith(".service"):
                out.append(task)
        return out

    return [(path, task) for path in sorted((role / "tasks").glob("*.yml"))
            for task in walk(yaml.safe_load(path.read_text()))]


def test_every_unit_a_role_writes_is_verified_and_restarts_through_a_listening_handler() -> None:
    units = {role.name: unit_templates(role) for role in ALL_ROLES}
    assert {"llama_server", "monitoring"} <= {name for name, found in units.items() if found}
    for role in ALL_ROLES:
        handlers = yaml.safe_load((role / "handlers" / "main.yml").read_text()) or []
        listened = {topic for handler in handlers for topic in handler.get("listen") or []}
        for path, task in units[role.name]:
            where = f"{path.relative_to(ROLES)}: {task['name']}"
            assert "systemd-analyze verify" in str(task["ansible.builtin.template"].get("validate", "")), where
            notified = task.get("notify")
            notified = [notified] if isinstance(notified, str) else list(notified or [])
            assert notified and set(notified) <= listened, f"{where}: notifies {notified}, handlers listen {listened}"


@pytest.mark.parametrize("role", ALL_ROLES, ids=lambda p: p.name)
def test_every_role_has_a_readme(role: Path) -> None:
    readme = role / "README.md"
    assert readme.is_file() and readme.read_text().startswith(f"# {role.name}\n")
