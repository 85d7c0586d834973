"""``rigctl build upgrade``: a llama.cpp upgrade as one gated command.

**Upgrade** (:func:`upgrade`), for the hosts that share the canary's pin (the file that pins it):

1. before anything is fetched or built: the gates are read and checked, the pin is checked against the
   CVE floor (:mod:`rigctl.inventory.advisories`); then the archive is fetched (its sha256 recorded on first
   fetch, checked ever after: :mod:`rigctl.fleet.candidate`);
2. the candidate is built on the canary beside the current build, never made current, and every profile's
   flags (and the gates' llama-bench flags) are checked against its own ``--help``;
3. the canary measures the candidate against the current build, paired (:mod:`rigctl.upgrade.paired`);
4. every gate passed: the pin is written into the inventory (:mod:`rigctl.inventory.edit`: comments, order
   and quoting kept; ``inventory check`` must pass or no file is written) and rolled out host by host,
   canary first, with the roles' health-gated rollout; each host's servers must answer on the new build
   before the next starts. A gate failed (or stayed undecided at its budget): the candidate is dropped
   (the role's normal run), the canary keeps serving the current build, the inventory is not touched, and
   :class:`UpgradeRefused` names the failed gate with its figures in one line.

The run is an ``upgrade`` record in the results store (both builds' stamps, every measurement's raw rows,
the bench and eval runs it made, the verdict, the rollout); ``rigctl report`` renders it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rigctl.errors import BuildError, ConfigError, DeployError, RigctlError
from rigctl.fleet import candidate
from rigctl.fleet.build import Build, read_builds
from rigctl.fleet.candidate import CandidateBuild, CandidatePin
from rigctl.fleet.deploy import roles_paths
from rigctl.fleet.drain import refuse_drained
from rigctl.fleet.servers import host_status, unit_states
from rigctl.inventory import Host, Inventory, Server, advisories
from rigctl.inventory.edit import InventoryEdit, OutsideText, round_trip_yaml, vars_file
from rigctl.inventory.gates import GATES_VAR, Gates
from rigctl.results.record import Provenance, RunKind
from rigctl.results.run import Run
from rigctl.results.stamp import inventory_server, inventory_stamp
from rigctl.results.store import ResultsStore, StoredRun
from rigctl.ssh import session
from rigctl.upgrade import gates as g
from rigctl.upgrade import paired

log = logging.getLogger(__name__)

Say = Callable[[str], None]
GATES_FILE = "gates.json"
HELP_DIR = "help"
#: The variables an upgrade writes, as a pin moves.
PIN_KEYS = ("llama_cpp_version", "llama_cpp_archive", "llama_cpp_archive_sdist", "llama_cpp_cmake_options",
            "rigctl_allowed_advisories")


class UpgradeRefused(BuildError):
    """The upgrade did not go ahead: a gate failed (its figures in the message), a flag is unknown to the
    candidate, or the pin is inside an advisory's range. ``problems``: one line each."""

    def __init__(self, problems: Sequence[str], run: str | None = None):
        self.problems = list(problems)
        self.run = run
        super().__init__("; ".join(self.problems))


# ----------------------------------------------------------------------------------------------- scope and pin


def pin_origin(inventory: Inventory, host: Host) -> str:
    """Where ``host``'s pin is written: ``group NAME`` or ``host NAME``."""
    return inventory.origin(host, "llama_cpp_version")


def scope(inventory: Inventory, canary: Host) -> list[Host]:
    """The hosts an upgrade of ``canary`` moves: those whose pin is written where the canary's is, canary first."""
    origin = pin_origin(inventory, canary)
    others = [h for h in inventory.hosts.values() if h.name != canary.name and "llama_cpp_source" in h.vars
              and pin_origin(inventory, h) == origin]
    return [canary, *others]


class PinFiles:
    """The inventory files an upgrade edits: each variable in the file of ``origin`` that defines it, staged in
    one :class:`~rigctl.inventory.edit.InventoryEdit` (round trip; checked before it lands)."""

    def __init__(self, inventory: Inventory, origin: str):
        self.inventory = inventory
        self.origin = origin
        self.edit = InventoryEdit(inventory.source, roles_paths(), what="the new pin")

    def raw(self, key: str) -> Any:
        """``key`` as its file writes it (templates unrendered); None when no file of the origin defines it."""
        try:
            path = vars_file(self.inventory, self.origin, key)
        except ConfigError:
            return None
        return round_trip_yaml().load(path.read_text())[key]

    def write(self, values: Mapping[str, Any]) -> list[Path]:
        """Stage ``values`` (top-level keys; a mapping value is merged into the one there) each in the file that
        defines it (the pin's file for a new key); the files staged."""
        pin_file = vars_file(self.inventory, self.origin, "llama_cpp_version")
        by_file: dict[Path, dict[str, Any]] = {}
        for key, value in values.items():
            try:
                path = vars_file(self.inventory, self.origin, key)
            except ConfigError:
                path = pin_file
            by_file.setdefault(path, {})[key] = value
        for path, updates in by_file.items():
            self.edit.update(path, updates, merge=True)
        return list(by_file)


def pin_values(pin: CandidatePin, allowed: Mapping[str, str]) -> dict[str, Any]:
    """What the inventory holds for ``pin`` (the archive's sha256 from its first fetch)."""
    values: dict[str, Any] = {"llama_cpp_version": pin.version}
    if pin.source == "archive":
        values["llama_cpp_archive"] = {"path": pin.archive_path_raw, "sha256": pin.sha256}
        values["llama_cpp_archive_sdist"] = pin.sdist
    if pin.cmake_options:
        values["llama_cpp_cmake_options"] = dict(pin.cmake_options)
    if allowed:
        values["rigctl_allowed_advisories"] = dict(allowed)
    return values


def write_pin(inventory: Inventory, canary: Host, pin: CandidatePin, allowed: Mapping[str, str],
              hosts: Sequence[str]) -> tuple[Inventory, list[Path]]:
    """Write ``pin`` where the canary's pin is; the inventory again, and the files written. An inventory that
    would fail ``inventory check``, or in which the pin would not reach every one of ``hosts``, is refused
    (ConfigError) before any file is written."""
    files = PinFiles(inventory, pin_origin(inventory, canary))
    values = pin_values(pin, allowed)
    if allowed:  # a reason is plain text: Ansible must never template what a command line gave
        values[advisories.ALLOWED_VAR] = {ident: OutsideText(reason) for ident, reason in allowed.items()}
    files.write(values)

    def reaches_every_host(staged: Inventory) -> None:
        moved = [name for name in hosts if staged.host(name).llama_cpp.version != pin.version]
        if moved:
            raise ConfigError(f"the new pin did not reach {', '.join(moved)} (another file pins them)")

    written = files.edit.commit(verify=reaches_every_host)
    return Inventory.load(inventory.source), written


# ----------------------------------------------------------------------------------------------- records


def run_stamp(host: Host, server: Server | None) -> Provenance:
    """The stamp an upgrade or bisect record begins with: ``server`` (when it runs now: a stopped one is
    measured through probes, whose argv the measurements' own records carry) and its artifact."""
    running = server is not None and _active(host, server)
    return inventory_stamp(host, [inventory_server(host, server.name)] if server and running else [],
                           artifacts=[server.artifact] if server else [])


@contextmanager
def upgrade_run(kind: RunKind, host: Host, server: Server | None, store: ResultsStore,
                extra: Mapping[str, Any], previous: StoredRun | None = None) -> Iterator[Run]:
    """The ``upgrade`` or ``bisect`` run (:func:`rigctl.results.run.open_run`, or ``previous`` reopened: a
    bisect resumed), its stamp completed by the host. A refusal (:class:`UpgradeRefused`) is a verdict, not a
    failure: the run is sealed ``done`` with it, and the refusal goes on to the caller."""
    run = Run.reopen(previous) if previous is not None else Run.create(kind, run_stamp(host, server), store,
                                                                       host=host.name, extra=dict(extra))
    refusal: UpgradeRefused | None = None
    with run.sealing():
        if previous is None:
            with session(host) as ssh:
                run.complete_stamp(ssh)
        try:
            yield run
        except UpgradeRefused as exc:
            refusal = exc
    if refusal is not None:
        raise refusal


def _build_dict(build: Build | None) -> dict[str, Any] | None:
    if build is None:
        return None
    fields = asdict(build)
    fields["cmake_flags"] = list(build.cmake_flags)
    return fields


def _save_help(run_dir: Path, name: str, text: str) -> None:
    (run_dir / HELP_DIR).mkdir(exist_ok=True)
    (run_dir / HELP_DIR / name).write_text(text)


# ----------------------------------------------------------------------------------------------- shared steps


def floor_check(pin: CandidatePin, build_number: int | None, allowed: Mapping[str, str]) -> None:
    if build_number is None:
        return
    check = advisories.check_build(build_number, allowed)
    if check.vulnerable:
        raise UpgradeRefused([check.refusal(f"llama.cpp {pin.version}")])


def check_flags(hosts: Sequence[Host], host: Host, build: Build, gates: Gates, run_dir: Path | None) -> list[str]:
    """The flags the candidate does not know: every profile of ``hosts``' servers against its llama-server's
    ``--help``, the gates' bench matrix against its llama-bench's; the help texts saved in ``run_dir``."""
    server_help = candidate.tool_help(host, f"{build.dir}/bin/llama-server")
    bench_help = candidate.tool_help(host, f"{build.dir}/bin/llama-bench") if gates.bench else None
    if run_dir is not None:
        _save_help(run_dir, "llama-server.txt", server_help)
        if bench_help is not None:
            _save_help(run_dir, "llama-bench.txt", bench_help)
    servers = [s for h in hosts for s in h.servers]
    points = paired.bench_points(g.served(host, gates), gates.bench) if gates.bench else []
    bench = sorted({flag for point in points for flag in candidate.bench_flags(point.matrix.flags())})
    return candidate.unknown_flags(servers, candidate.parse_help_flags(server_help), bench,
                                   candidate.parse_help_flags(bench_help) if bench_help else None, build=build.name)


# ----------------------------------------------------------------------------------------------- upgrade


@dataclass
class HostRollout:
    host: str
    ok: bool
    seconds: float
    current: str | None = None
    servers: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None


@dataclass
class UpgradeResult:
    run: str  # host/run id
    verdict: str  # "pass"
    version: str
    results: list[g.GateResult]
    written: list[Path]
    rollout: list[HostRollout]


def _serving_check(host: Host, build: str) -> list[dict[str, Any]]:
    """Every enabled instance of ``host`` answering on a build whose /props names ``build``'s number."""
    rows = []
    for status in host_status(host):
        if not status.enabled:
            continue
        rows.append({"server": status.name, "healthy": status.healthy, "build_info": status.build,
                     "state": status.state})
        if not status.healthy or not status.build or build not in status.build:
            raise DeployError(f"{host.name}/{status.name}: after the rollout it answers {status.health}, "
                              f"build {status.build or 'unknown'}, not {build}")
    return rows


def rollout(inventory: Inventory, hosts: Sequence[str], version: str, say: Say,
            on_event: Callable[[Any], None] | None = None) -> list[HostRollout]:
    """The new pin onto ``hosts`` one at a time (the llama_cpp and llama_server roles: build or copy, smoke test,
    current, then each instance restarted until /health and /props answer, or put back); a host whose servers
    do not answer on the new build stops the rollout (DeployError), the hosts before it stay upgraded."""
    from rigctl.fleet.deploy import run_playbook

    done: list[HostRollout] = []
    for name in hosts:
        started = time.monotonic()
        say(f"rollout {name}: llama_cpp and llama_server for {version}")
        result = run_playbook(inventory, "site.yml", limit=name, tags=["llama_cpp", "llama_server"],
                              on_event=on_event)
        try:
            result.raise_for_failures()
            current = read_builds(inventory.host(name)).current
            if current is None or current.version != version:
                raise DeployError(f"{name}: current is {current}, not {version}")
            number = advisories.build_number(version)
            servers = _serving_check(inventory.host(name), str(number) if number is not None else current.commit)
        except RigctlError as exc:
            done.append(HostRollout(name, False, time.monotonic() - started, error=str(exc)))
            raise DeployError(f"rollout stopped at {name}: {exc} (upgraded before it: "
                              f"{', '.join(h.host for h in done if h.ok) or 'none'})") from None
        done.append(HostRollout(name, True, time.monotonic() - started, current.name, servers))
        say(f"rollout {name}: current {current.name}; " + ", ".join(
            f"{s['server']} answers ({s['build_info']})" for s in servers))
    return done


def upgrade(inventory: Inventory, version: str, *, canary: str | None = None, gates_file: Path | None = None,
            cmake_options: Mapping[str, str] | None = None, allow: Mapping[str, str] | None = None,
            store: ResultsStore | None = None, say: Say = lambda _: None,
            on_event: Callable[[Any], None] | None = None, tag: str | None = None,
            sha256: str | None = None) -> UpgradeResult:
    """Upgrade the canary's fleet (the hosts sharing its pin) to ``version``; see the module's docstring.
    UpgradeRefused (one line per problem) when a gate, a flag or the CVE floor refuses it. ``tag``: what the
    record carries as ``extra.campaign`` (a campaign's step). ``sha256``: the archive's, known from elsewhere (a
    first fetch is otherwise held to the index's own hash, over https)."""
    store = store or ResultsStore()
    canary_host = inventory.host(canary) if canary else next(
        (h for h in inventory.hosts.values() if "llama_cpp_source" in h.vars), None)
    if canary_host is None:
        raise ConfigError("no host of the inventory pins llama.cpp")
    refuse_drained([canary_host], "a canary")
    hosts = scope(inventory, canary_host)
    gates = g.load_gates(canary_host.vars.get(GATES_VAR), f"host {canary_host.name}", gates_file)
    g.check_gates(gates, canary_host, f"--gates {gates_file}" if gates_file else
                  f"host {canary_host.name}: {GATES_VAR}")
    allowed = {**advisories.host_allowed(canary_host), **advisories.allowed_advisories(allow, "--allow-advisory",
                                                                                     written=True)}
    files = PinFiles(inventory, pin_origin(inventory, canary_host))
    archive = files.raw("llama_cpp_archive")
    pin = candidate.pin_for(canary_host, version, str(archive.get("path")) if isinstance(archive, Mapping) else None,
                            cmake_options=cmake_options)
    if sha256 is not None:
        pin = candidate.with_sha256(pin, sha256)
    current_pin = canary_host.llama_cpp
    if pin.version == current_pin.version and not pin.cmake_options:
        raise ConfigError(f"--to {version}: {canary_host.name} pins {version} already")
    floor_check(pin, pin.build_number, allowed)  # before anything is fetched or built
    servers = g.served(canary_host, gates)
    pin = candidate.fetch_archive(pin)
    say(f"{pin.label}: archive {pin.archive_path} sha256 {pin.sha256}" if pin.source == "archive" else pin.label)
    before = read_builds(canary_host)
    if before.current is None:
        raise BuildError(f"{canary_host.name}: no current llama.cpp build to upgrade from; provision it first")
    extra = {"to": pin.version, "label": pin.label, "from": current_pin.version, "canary": canary_host.name,
             "scope": [h.name for h in hosts], "instances": _instances(servers), "gates": gates.model_dump(),
             "pin": pin_values(pin, allowed), "current": _build_dict(before.current),
             "accepted_advisories": dict(allowed), **({"campaign": tag} if tag else {})}
    with upgrade_run("upgrade", canary_host, servers[0], store, extra) as run:
        return _canary_and_rollout(inventory, run, canary_host, hosts, servers, pin, before.current, gates, allowed,
                                   store, say, on_event)


def _instances(servers: Sequence[Server]) -> list[dict[str, str]]:
    """What a record says the gates measured: each instance, its profile and its artifact."""
    return [{"instance": s.name, "profile": s.profile.name, "artifact": s.artifact} for s in servers]


def _canary_and_rollout(inventory: Inventory, run: Run, canary: Host, hosts: Sequence[Host], servers: Sequence[Server],
                        pin: CandidatePin, current: Build, gates: Gates, allowed: Mapping[str, str],
                        store: ResultsStore, say: Say, on_event: Callable[[Any], None] | None) -> UpgradeResult:
    """The candidate built, checked and measured on the canary; the pin written and rolled out, or the candidate
    dropped and :class:`UpgradeRefused` raised (the record in ``run`` says which)."""
    record, ref = run.record, run.ref
    say(f"upgrade {ref}: candidate {pin.label} on {canary.name}, gates {GATES_FILE}")
    built = candidate.build_candidate(inventory, canary.name, pin, on_event=on_event)
    record.extra["candidate"] = {**(_build_dict(built.build) or {}), "plan": built.plan,
                                 "seconds": round(built.seconds, 1)}
    run.save()
    say(f"candidate {built.build.name}: {built.plan} in {built.seconds:.0f} s")
    refusal = _pre_measure_refusal(pin, built, hosts, canary, gates, allowed, run.path)
    if refusal:
        record.extra.update(verdict="refused", refused_by="flags" if "profile" in refusal[0] or "bench matrix"
                            in refusal[0] else "advisory", problems=refusal)
        candidate.drop_candidate(inventory, canary.name, on_event=on_event)
        raise UpgradeRefused(refusal, ref)
    # The current build answers as the instance itself when it runs, else as a probe like the candidate.
    measured = paired.measure(canary, servers, paired.Side("current", current),
                              paired.Side("candidate", built.build), gates, store, run.path,
                              a_running=[s.name for s in servers if _active(canary, s)], say=say,
                              record_extra={"upgrade": ref})
    record.extra.update(measurement=measured.to_dict())
    run.write_json(GATES_FILE, measured.to_dict())
    if measured.verdict != "pass":
        failed = g.first_failure(measured.results)
        assert failed is not None
        state = "failed" if failed.verdict == "fail" else "could not decide within its budget"
        line = (f"upgrade to {pin.label} refused by gate {failed.title} ({state}): {failed.figures}; "
                f"{canary.name} serves {current.name}, the inventory is unchanged (record {ref})")
        candidate.drop_candidate(inventory, canary.name, on_event=on_event)
        record.extra.update(verdict="refused", refused_by=failed.gate, problems=[line],
                            current_after=_build_dict(read_builds(canary).current))
        raise UpgradeRefused([line], ref)
    reloaded, written = write_pin(inventory, canary, pin, allowed, [h.name for h in hosts])
    record.extra.update(verdict="pass", written=[str(p) for p in written])
    run.save()
    say(f"every gate passed; pin {pin.label} written to {', '.join(str(p) for p in written)}")
    rolled: list[HostRollout] = []
    try:
        rolled = rollout(reloaded, [h.name for h in hosts], pin.version, say, on_event)
    finally:
        record.extra["rollout"] = [asdict(r) for r in rolled]
    return UpgradeResult(ref, "pass", pin.version, measured.results, written, rolled)


def _pre_measure_refusal(pin: CandidatePin, built: CandidateBuild, hosts: Sequence[Host], canary: Host,
                         gates: Gates, allowed: Mapping[str, str], run_dir: Path) -> list[str]:
    """Before the candidate serves anything: a git pin's build number against the CVE floor (now that the
    build reports it), and every flag against the candidate's own --help."""
    if pin.source == "git":
        check = advisories.check_build(built.build.build_number, allowed)
        if check.vulnerable:
            return [check.refusal(f"llama.cpp {pin.version}")]
    return check_flags(hosts, canary, built.build, gates, run_dir)


def _active(host: Host, server: Server) -> bool:
    state = unit_states(host, [server.name]).get(server.name)
    return state is not None and state.active_state == "active"


def _installed(host: Host, build: Build) -> bool:
    with session(host) as ssh:
        return ssh.run(f"test -f {build.dir}/build.json", timeout=30, check=False).rc == 0
