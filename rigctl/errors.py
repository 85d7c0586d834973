"""The one error tree of rigctl.

Every error rigctl raises on purpose derives from :class:`RigctlError`; the CLI prints
``error: <str(exc)>`` for these and exits non-zero, so each message is one line that names the
culprit (host, group, key, path, command).
"""

from __future__ import annotations

import re


class RigctlError(Exception):
    """Base of every error rigctl raises on purpose."""

    exit_code = 1


class ConfigError(RigctlError):
    """The inventory, a spec file or a command-line argument is wrong."""

    exit_code = 2


class ProblemsError(ConfigError):
    """Several problems in one input (a gates file's bad keys): the CLI prints one ``error:`` line for each."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


class LabError(RigctlError):
    """The local lab rigs cannot be created, found or removed."""


class ConnectError(RigctlError):
    """An SSH connection to ``host`` failed (refused, timed out, authentication)."""

    def __init__(self, host: str, reason: str):
        self.host = host
        self.reason = reason
        super().__init__(f"{host}: cannot connect: {reason}")


class HostKeyError(ConnectError):
    """``host`` presented a key that is not the one in known_hosts (or none is known)."""

    def __init__(self, host: str, reason: str):
        super().__init__(host, reason)
        self.args = (f"{host}: host key rejected: {reason}",)

    def __str__(self) -> str:
        return self.args[0]


class ForwardError(ConnectError):
    """``host``'s SSH connection will not forward to ``target`` (``address:port`` as the host sees it), where a
    server listens on the host's loopback only: its sshd refuses forwarding (``AllowTcpForwarding no``)."""

    def __init__(self, host: str, target: str, reason: str):
        super().__init__(host, reason)
        self.target = target
        self.args = (f"{host}: cannot forward to {target} over SSH: {reason}",)

    def __str__(self) -> str:
        return self.args[0]


class SudoRefusedError(ConnectError):
    """``host``'s login user is not root and sudo will not run a command as root without a password."""

    def __init__(self, host: str, user: str, reason: str):
        super().__init__(host, reason)
        self.args = (f"{host}: {user} logs in but cannot act as root: the fleet user needs passwordless sudo "
                     f"(sudo -n said: {reason})",)

    def __str__(self) -> str:
        return self.args[0]


#: The entry of a command :func:`rigctl.hostside.ship.python_command` made (the module names are shell-quoted).
_SHIPPED_ENTRY = re.compile(r"sys\.modules\[\W*rigctl\.hostside\.(\w+)\W*\]\.main\(")
_SHOWN_CHARS = 160


def shown_command(cmd: str) -> str:
    """``cmd`` as one line of an error: a shipped host-side module by its name (its command line carries the
    module's whole source), any other command of several lines or over 160 characters cut short."""
    shipped = _SHIPPED_ENTRY.search(cmd)
    if cmd.startswith("python3 -c ") and shipped:
        return f"python3 -c <rigctl.hostside.{shipped.group(1)}>"
    first = cmd.splitlines()[0] if cmd.strip() else cmd
    return cmd if first == cmd and len(cmd) <= _SHOWN_CHARS else first[:_SHOWN_CHARS] + " ..."


class RemoteCommandError(RigctlError):
    """A command on ``host`` exited non-zero or ran past its timeout (``cmd`` and ``tail`` whole, the message
    shortened)."""

    def __init__(self, host: str, cmd: str, rc: int | None, tail: str = ""):
        self.host = host
        self.cmd = cmd
        self.rc = rc
        self.tail = tail
        status = "timed out" if rc is None else f"exited {rc}"
        last = tail.strip().splitlines()[-1] if tail.strip() else ""
        if len(last) > _SHOWN_CHARS:  # a JSON answer cut off by the timeout is one long line
            last = last[:_SHOWN_CHARS] + " ..."
        super().__init__(f"{host}: `{shown_command(cmd)}` {status}" + (f": {last}" if last else ""))


class TransferError(RigctlError):
    """An SFTP transfer to or from ``host`` failed, timed out or did not match its sha256."""

    def __init__(self, host: str, path: str, reason: str):
        self.host = host
        self.path = path
        self.reason = reason
        super().__init__(f"{host}: {path}: {reason}")


class DeployError(RigctlError):
    """An Ansible run failed: a host was unreachable or a task failed."""


class DrainedError(RigctlError):
    """A drained host asked to run a campaign step, an eval, a bench or a canary: the host and why."""


class BuildError(RigctlError):
    """A host has no llama.cpp build, or its build cannot be changed as asked."""


class PinError(RigctlError):
    """A model file's sha256 differs from its pin, or a manifest is missing or unreadable."""


class ServerError(RigctlError):
    """A llama-server (or OpenAI-compatible endpoint) could not be reached or answered with an error."""

    def __init__(self, endpoint: str, what: str, reason: str, status: int | None = None):
        self.endpoint = endpoint
        self.status = status
        super().__init__(f"{endpoint}: {what}: {reason}")


class UnreadableAnswer(ServerError):
    """A server answered with JSON that Python cannot hold (too deep, a number too long, a lone surrogate).
    An eval scores it as a wrong answer with ``reason``; everything else treats it as any ServerError."""

    def __init__(self, endpoint: str, what: str, reason: str):
        self.reason = reason
        super().__init__(endpoint, what, reason)


class EvalError(RigctlError):
    """An eval task, its dataset or a run cannot be loaded, verified or resumed."""


class CheckError(RigctlError):
    """A runtime check (`rigctl check template|logits`) cannot run its reference side."""


class JobError(RigctlError):
    """A job on a host cannot be started, found, followed or pulled, or it failed."""


class JobBusyError(JobError):
    """A host's job lock is held: ``running`` names the job that holds it."""

    def __init__(self, host: str, lock: str, running: str):
        self.host = host
        self.lock = lock
        self.running = running
        super().__init__(f"{host}: refused: job {running} is running and holds the {lock!r} lock; "
                         f"wait for it (`rigctl jobs {host}`) or stop it")


class TrustError(RigctlError):
    """Something from outside (a rig, a record, a tool's argument) named a path outside its place or an
    identifier of the wrong shape; what it sent is refused, and nothing of it is written."""


class DeployBusyError(DeployError):
    """Another rigctl run of this controller holds ``host`` (at ``address``): ``holder`` is its record
    (:func:`rigctl.hostside.play_lock.controller_holder`)."""

    def __init__(self, host: str, address: str, holder: dict[str, object]):
        from rigctl.hostside.play_lock import describe

        self.host = host
        self.holder = holder
        self.pid = holder.get("pid")
        self.command = str(holder.get("command") or "?")
        super().__init__(f"{host}: refused: {describe(holder)} is running a play against {address}; "
                         "wait for it to finish")


class ProbeError(RigctlError):
    """What ``host`` reported when probed (``rigctl hosts probe``) is missing or malformed at ``field``."""

    def __init__(self, host: str, field: str, reason: str):
        self.host = host
        self.field = field
        super().__init__(f"{host}: probe: {field}: {reason}")


class EnrollError(RigctlError):
    """A host cannot be added to (or removed from) the inventory: first contact, bootstrap or the
    inventory files refused it."""


#: The longest one-line description of an exception rigctl did not raise on purpose (a host's answer or a
#: record can make its message as long as it likes).
ONE_LINE_MAX = 300


def one_line(exc: BaseException) -> str:
    """``exc`` as the one line a fan-out reports for the host or record it came from: rigctl's own message,
    an OSError's reason and file, else the exception's type and message; whitespace folded, capped."""
    if isinstance(exc, RigctlError):
        text = str(exc)
    elif isinstance(exc, OSError) and exc.strerror:
        text = f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    else:
        text = f"{type(exc).__name__}: {exc}"
    text = " ".join(text.split())
    return text if len(text) <= ONE_LINE_MAX else text[:ONE_LINE_MAX - 3] + "..."
