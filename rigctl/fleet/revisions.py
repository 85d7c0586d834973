"""``rigctl models pin-revisions``: each Hugging Face model source whose ``revision`` is a branch or tag
(``main``) pinned to the commit it names now, written into the inventory round trip.

The models role converts only from a commit (the converter runs over the checkout, so it must be the one
that was looked at), and ``inventory check`` warns on every branch; a catalog as people write it says
``main``. The commit comes from the Hugging Face API on ``HF_ENDPOINT`` (a mirror's, else the hub's):
``GET {endpoint}/api/models/{repo}/revision/{revision}`` answers a JSON object whose ``sha`` is the commit
(``HF_TOKEN``, when set, goes to that endpoint's origin only, for gated repositories). Every source is
resolved before anything is written: an endpoint that does not answer in time, answers an error, or answers
anything but an object with a 40-hex ``sha`` stops the command with one line and no file changed. The files
are then edited with ruamel.yaml (comments, order and quoting stay), each written atomically; the branch the
commit came from is kept as the line's comment.
"""

from __future__ import annotations

import json
import logging
import os
import urllib.parse
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rigctl.errors import ConfigError, PinError
from rigctl.fleet.deploy import roles_paths
from rigctl.hostside.token_origin import bearer_header, hf_endpoint
from rigctl.inventory import Inventory
from rigctl.inventory.edit import InventoryEdit, round_trip_yaml, vars_file
from rigctl.inventory.keys import FULL_COMMIT
from rigctl.trust import register_secret

log = logging.getLogger(__name__)

CATALOG_KEY = "models_catalog"
DEFAULT_TIMEOUT_S = 30.0
_ANSWER_LIMIT = 1 << 20  # a revision's listing; its siblings make it long for big repositories


@dataclass(frozen=True)
class Revision:
    """One catalog source: where it is written, what it says, and (once resolved) its commit."""

    file: Path
    model: str
    repo: str
    revision: str
    commit: str | None = None


def catalog_files(inventory: Inventory) -> list[Path]:
    """The group_vars/host_vars files that define a ``models_catalog`` some host uses, each once."""
    origins = {inventory.origin(host, CATALOG_KEY) for host in inventory.hosts.values() if CATALOG_KEY in host.vars}
    return sorted({vars_file(inventory, origin, CATALOG_KEY) for origin in origins})


def _load(path: Path) -> Any:
    try:
        return round_trip_yaml().load(path.read_text(encoding="utf-8"))
    except Exception as exc:  # ruamel's errors have no common base worth naming
        raise ConfigError(f"{path}: not YAML rigctl can edit: {str(exc).splitlines()[0]}") from None


def unpinned(path: Path) -> list[Revision]:
    """The hf sources of ``path``'s catalog whose revision is not a full commit."""
    catalog = _load(path).get(CATALOG_KEY)
    if not isinstance(catalog, dict):
        raise ConfigError(f"{path}: {CATALOG_KEY} is not a mapping")
    out = []
    for model, spec in catalog.items():
        source = spec.get("source") if isinstance(spec, dict) else None
        if not isinstance(source, dict) or source.get("type") != "hf":
            continue
        revision, repo = source.get("revision"), source.get("repo")
        where = f"{path}: {CATALOG_KEY}.{model}.source"
        if not isinstance(repo, str) or not isinstance(revision, str) or not revision:
            raise ConfigError(f"{where}: an hf source needs repo and revision (strings)")
        if "{{" in revision or "{%" in revision:
            raise ConfigError(f"{where}.revision: {revision!r} is a template; pin it where it is defined")
        if not FULL_COMMIT.fullmatch(revision):
            out.append(Revision(path, str(model), repo, revision))
    return out


def resolve(source: Revision, *, endpoint: str, token: str | None, timeout: float) -> str:
    """The commit ``source.revision`` names now, as the endpoint's API says; PinError (one line) otherwise."""
    import httpx

    url = (f"{endpoint}/api/models/{urllib.parse.quote(source.repo, safe='/')}/revision/"
           f"{urllib.parse.quote(source.revision, safe='')}")
    what = f"{source.model}: {source.repo}@{source.revision}: GET {url}"
    try:
        with httpx.Client(timeout=httpx.Timeout(timeout), follow_redirects=False) as client, \
                client.stream("GET", url, headers=bearer_header(token, url, endpoint)) as response:
            if response.status_code != 200:
                raise PinError(f"{what}: HTTP {response.status_code}"
                               + (" (a gated or private repository needs HF_TOKEN)"
                                  if response.status_code in (401, 403) else ""))
            body = b""
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > _ANSWER_LIMIT:
                    raise PinError(f"{what}: the answer is larger than {_ANSWER_LIMIT} bytes")
    except httpx.TimeoutException:
        raise PinError(f"{what}: no answer within {timeout:g} s") from None
    except httpx.HTTPError as exc:
        raise PinError(f"{what}: {type(exc).__name__}: {exc}") from None
    try:
        answer = json.loads(body)
    except (ValueError, RecursionError):
        raise PinError(f"{what}: the answer is not JSON") from None
    sha = answer.get("sha") if isinstance(answer, dict) else None
    if not isinstance(sha, str) or not FULL_COMMIT.fullmatch(sha):
        shown = repr(sha)[:60] if isinstance(answer, dict) else f"a JSON {type(answer).__name__}"
        raise PinError(f"{what}: the answer names no commit (sha {shown}; a commit is 40 lower-case hex digits)")
    return sha


def pin_in(data: Any, revisions: list[Revision], when: str) -> Any:
    """A catalog file's document with each of ``revisions`` (resolved) written in place, the branch kept as a
    comment."""
    for item in revisions:
        source = data[CATALOG_KEY][item.model]["source"]
        source["revision"] = item.commit
        source.yaml_add_eol_comment(f"{item.revision} on {when} (rigctl models pin-revisions)", "revision")
    return data


def pin_revisions(inventory: Inventory, *, timeout: float = DEFAULT_TIMEOUT_S) -> list[Revision]:
    """Resolve every unpinned hf source of the inventory's catalogs, then write them all; the sources
    pinned (empty: nothing to do). Nothing is written unless every source resolved."""
    files = catalog_files(inventory)
    if not files:
        raise ConfigError(f"inventory {inventory.source}: no host uses a {CATALOG_KEY}")
    endpoint = hf_endpoint()
    token = os.environ.get("HF_TOKEN") or None
    register_secret(token)
    todo = [item for path in files for item in unpinned(path)]
    resolved = [Revision(item.file, item.model, item.repo, item.revision,
                         resolve(item, endpoint=endpoint, token=token, timeout=timeout)) for item in todo]
    when = datetime.now(UTC).strftime("%Y-%m-%d")
    edit = InventoryEdit(inventory.source, roles_paths(), what="models pin-revisions")
    for path in files:
        mine = [r for r in resolved if r.file == path]
        if mine:
            edit.write(path, pin_in(edit.read(path), mine, when))
    edit.commit()
    for path in edit.changed:
        log.info("%s: pinned %d sources", path, sum(r.file == path for r in resolved))
    return resolved
