#!/usr/bin/python3
# Part of rigctl's models role.
"""Download a model source on the host: a Hugging Face repository at a revision, or one URL with a sha256."""

from __future__ import annotations

DOCUMENTATION = r"""
module: models_fetch
short_description: Download a Hugging Face checkout or a URL into a directory, verified, atomically
description:
  - C(hf) lists the repository at I(revision) with C({endpoint}/api/models/{repo}/revision/{revision}),
    downloads each file from C({endpoint}/{repo}/resolve/{commit}/{file}) (the Hugging Face URL layout,
    so C(HF_ENDPOINT) mirrors work) and checks each file's size and, where the listing gives one, its
    LFS sha256. C(url) downloads one file and checks its sha256.
  - Every name the listing gives must be a plain relative path inside the checkout (no C(..), not
    absolute, no empty component, backslash or control character); one that is not fails the module
    before anything is written.
  - A checkout that carries code the converter would run (Python files, an C(auto_map) in a JSON config)
    is refused unless I(trust_remote_code) is set - Python files by their names in the listing, before
    any download; the JSON files are fetched first and read before anything else is.
  - Files land in I(dest).partial and the directory is renamed to I(dest) only when complete; a
    marker (.rigctl-source.json) records what was fetched. Present and complete: changed is false.
  - With I(list_only) nothing is written; the listing (files, sizes, commit) is returned, for the
    free-disk estimate. Supports check mode.
options:
  type: {description: Source type., type: str, required: true, choices: [hf, url]}
  dest: {description: Directory the files land in., type: path, required: true}
  host: {description: Inventory name of the host, for messages., type: str, required: true}
  name: {description: Model name, for messages., type: str, required: true}
  endpoint: {description: Hugging Face endpoint (HF_ENDPOINT)., type: str, default: ""}
  repo: {description: Repository (owner/name)., type: str, default: ""}
  revision: {description: Commit, branch or tag., type: str, default: main}
  files: {description: Only these files (default all)., type: list, elements: str, default: []}
  token: {description: "Bearer token, sent only to the exact origin of I(endpoint) (dropped on redirects).", type: str, default: "", no_log: true}
  url: {description: URL of the file (type url)., type: str, default: ""}
  sha256: {description: Its sha256 (type url)., type: str, default: ""}
  filename: {description: Name of the downloaded file (type url)., type: str, default: ""}
  timeout: {description: Seconds without progress before a request fails., type: int, default: 60}
  list_only: {description: Only list what would be fetched., type: bool, default: false}
  trust_remote_code: {description: "Accept a checkout with Python files or an auto_map (the catalog's trust_remote_code).", type: bool, default: false}
"""

import hashlib
import json
import os
import re
import shutil
import urllib.error
import urllib.parse
import urllib.request

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.model_checkout import CheckoutError, confined_name, describe, is_code, remote_code
from ansible.module_utils.token_origin import OriginBoundRedirects, bearer_header

MARKER = ".rigctl-source.json"
_FULL_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_SHA256 = re.compile(r"^[0-9a-fA-F]{64}$")


class FetchError(Exception):
    pass


def _open(url: str, token: str, endpoint: str, timeout: int):
    """GET ``url``; the token is sent only when ``url`` is on the endpoint's exact origin."""
    headers = {"User-Agent": "rigctl-models", **bearer_header(token, url, endpoint)}
    opener = urllib.request.build_opener(OriginBoundRedirects(endpoint))
    return opener.open(urllib.request.Request(url, headers=headers), timeout=timeout)


def hf_listing(endpoint: str, repo: str, revision: str, token: str, timeout: int) -> dict:
    """The repository at ``revision``: its commit and its files with size and LFS sha256."""
    url = f"{endpoint.rstrip('/')}/api/models/{repo}/revision/{urllib.parse.quote(revision, safe='')}?blobs=true"
    try:
        with _open(url, token, endpoint, timeout) as resp:
            info = json.load(resp)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise FetchError(f"cannot list {repo}@{revision} at {url}: {exc}") from None
    if not isinstance(info, dict) or not isinstance(info.get("siblings", []), list):
        raise FetchError(f"{url}: not a Hugging Face listing")
    commit = info.get("sha") or revision
    if not isinstance(commit, str) or not _FULL_COMMIT.match(commit):
        raise FetchError(f"{url}: the listing's commit {commit!r} is not 40 hex digits")
    files = {}
    for sibling in info.get("siblings", []):
        try:
            name = confined_name(sibling.get("rfilename") if isinstance(sibling, dict) else sibling)
        except CheckoutError as exc:
            raise FetchError(f"{repo}@{revision}: listed file {exc}; refused") from None
        lfs = sibling.get("lfs") or {}
        size, sha256 = sibling.get("size", lfs.get("size")), lfs.get("sha256", "")
        if not (size is None or type(size) is int) or not (sha256 == "" or _SHA256.match(str(sha256))):
            raise FetchError(f"{repo}@{revision}: listed file {name!r} has size {size!r} and sha256 {sha256!r}; "
                             "refused")
        files[name] = {"size": size, "sha256": sha256}
    return {"commit": commit, "files": files}


def download(url: str, target: str, token: str, endpoint: str, timeout: int, size: int | None, sha256: str) -> str:
    """Stream ``url`` to ``target``; check the byte count and sha256 given; return the sha256."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    digest = hashlib.sha256()
    got = 0
    try:
        with _open(url, token, endpoint, timeout) as resp, open(target, "wb") as out:
            length = resp.headers.get("Content-Length")
            while chunk := resp.read(1 << 20):
                out.write(chunk)
                digest.update(chunk)
                got += len(chunk)
    except (urllib.error.URLError, OSError) as exc:
        raise FetchError(f"{url}: {exc}") from None
    if length is not None and got != int(length):
        raise FetchError(f"{url}: got {got} bytes of {length} (truncated)")
    if size is not None and got != int(size):
        raise FetchError(f"{url}: got {got} bytes, the listing says {size}")
    hexdigest = digest.hexdigest()
    if sha256 and hexdigest != sha256.lower():
        raise FetchError(f"{url}: sha256 is {hexdigest}, expected {sha256.lower()}")
    return hexdigest


_OPT_IN = "models_catalog.{name}.trust_remote_code: true accepts it"


def _download_checkout(p: dict, files: dict, urls: dict, partial: str) -> dict:
    """Every file into ``partial``, the JSON configs first: a checkout whose auto_map would have the
    converter import the repository's code is refused before its weights are fetched."""
    configs = [rel for rel in files if rel.lower().endswith(".json")]
    weights = [rel for rel in files if rel not in configs]
    fetched = {}
    for batch in (configs, weights):
        for rel in batch:
            meta = files[rel]
            digest = download(urls[rel], os.path.join(partial, rel), p["token"], p["endpoint"], p["timeout"],
                              meta["size"], meta["sha256"])
            fetched[rel] = {"size": os.path.getsize(os.path.join(partial, rel)), "sha256": digest}
        code = remote_code(partial) if batch is configs and p["type"] == "hf" and not p["trust_remote_code"] else []
        if code:
            raise FetchError(f"{p['repo']} carries code the converter would run ({describe(code)}); "
                             f"refused ({_OPT_IN.format(name=p['name'])})")
    return fetched


def read_marker(dest: str) -> dict | None:
    try:
        with open(os.path.join(dest, MARKER), encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    for rel, meta in marker.get("files", {}).items():
        try:
            if os.path.getsize(os.path.join(dest, rel)) != meta["size"]:
                return None
        except OSError:
            return None
    return marker


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "type": {"type": "str", "required": True, "choices": ["hf", "url"]},
            "dest": {"type": "path", "required": True},
            "host": {"type": "str", "required": True},
            "name": {"type": "str", "required": True},
            "endpoint": {"type": "str", "default": ""},
            "repo": {"type": "str", "default": ""},
            "revision": {"type": "str", "default": "main"},
            "files": {"type": "list", "elements": "str", "default": []},
            "token": {"type": "str", "default": "", "no_log": True},
            "url": {"type": "str", "default": ""},
            "sha256": {"type": "str", "default": ""},
            "filename": {"type": "str", "default": ""},
            "timeout": {"type": "int", "default": 60},
            "list_only": {"type": "bool", "default": False},
            "trust_remote_code": {"type": "bool", "default": False},
        },
        supports_check_mode=True,
    )
    p = module.params
    where = f"{p['host']}: model {p['name']}"
    dest = p["dest"]
    marker = read_marker(dest)
    # A pinned commit or a checksummed URL that is already here needs no network at all.
    if p["type"] == "url":
        pinned_identity = f"sha256:{p['sha256'].lower()}"
    else:
        pinned_identity = f"hf:{p['repo']}@{p['revision']}" if _FULL_COMMIT.match(p["revision"]) else None
    if marker is not None and pinned_identity and marker.get("id") == pinned_identity and not p["list_only"]:
        module.exit_json(changed=False, dest=dest, **marker)
    try:
        if p["type"] == "hf":
            listing = hf_listing(p["endpoint"], p["repo"], p["revision"], p["token"], p["timeout"])
            wanted = p["files"] or sorted(listing["files"])
            missing = [f for f in wanted if f not in listing["files"]]
            if missing:
                raise FetchError(f"{p['repo']}@{p['revision']} has no file {', '.join(missing)}")
            files = {f: listing["files"][f] for f in wanted}
            commit = listing["commit"]
            if _FULL_COMMIT.match(p["revision"]) and commit != p["revision"]:
                raise FetchError(f"the listing of {p['repo']}@{p['revision']} is for commit {commit}; refused")
            code = [f for f in files if is_code(f)]
            if code and not p["trust_remote_code"]:
                raise FetchError(f"{p['repo']}@{commit} carries Python the converter would run ({describe(code)}); "
                                 f"refused ({_OPT_IN.format(name=p['name'])})")
            base = f"{p['endpoint'].rstrip('/')}/{p['repo']}/resolve/{commit}/"
            urls = {f: base + urllib.parse.quote(f) for f in files}
            identity = f"hf:{p['repo']}@{commit}"
        else:
            try:
                name = confined_name(p["filename"] or os.path.basename(urllib.parse.urlparse(p["url"]).path))
            except CheckoutError as exc:
                raise FetchError(f"{p['url']}: {exc}") from None
            files = {name: {"size": None, "sha256": p["sha256"].lower()}}
            urls = {name: p["url"]}
            commit = ""
            identity = f"sha256:{p['sha256'].lower()}"
        if p["list_only"]:
            module.exit_json(changed=False, dest=dest, commit=commit, id=identity, files=files,
                             bytes=sum(int(m["size"] or 0) for m in files.values()))
        if marker is not None and marker.get("id") == identity:
            module.exit_json(changed=False, dest=dest, **marker)
        if module.check_mode:
            module.exit_json(changed=True, dest=dest, id=identity, commit=commit, files=files)
        partial = dest + ".partial"
        shutil.rmtree(partial, ignore_errors=True)
        try:
            fetched = _download_checkout(p, files, urls, partial)
        except FetchError:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    except FetchError as exc:
        module.fail_json(msg=f"{where}: {exc}")
    marker = {"id": identity, "commit": commit, "files": fetched}
    with open(os.path.join(partial, MARKER), "w", encoding="utf-8") as f:
        json.dump(marker, f, indent=2, sort_keys=True)
    old = dest + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(dest):
        os.rename(dest, old)
    os.rename(partial, dest)
    shutil.rmtree(old, ignore_errors=True)
    module.exit_json(changed=True, dest=dest, **marker)


if __name__ == "__main__":
    main()
