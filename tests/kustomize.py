"""A small kustomize renderer for the tests of deploy/kubernetes: what ``kubectl kustomize`` makes of its folders.

It implements the fields those folders use: ``resources`` (files and folders), ``namespace`` (set on every resource
but a Namespace), ``labels`` (``pairs`` added to every resource's ``metadata.labels``) and ``patches`` (strategic
merge: maps merged key by key, lists of named maps merged by ``name``, other lists replaced), as kustomize does for
them (kubectl's ``kustomize`` is not installed here).
"""

from __future__ import annotations

import copy
from pathlib import Path

import yaml


def _merge(base, patch):
    """Strategic merge of ``patch`` into ``base`` (a copy)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = _merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    if (isinstance(base, list) and isinstance(patch, list) and patch and all(isinstance(x, dict) and "name" in x
                                                                             for x in base + patch)):
        out = [copy.deepcopy(x) for x in base]
        for item in patch:
            at = next((i for i, x in enumerate(out) if x["name"] == item["name"]), None)
            if at is None:
                out.append(copy.deepcopy(item))
            else:
                out[at] = _merge(out[at], item)
        return out
    return copy.deepcopy(patch)


def render(folder: Path) -> list[dict]:
    """The resources ``kubectl kustomize folder`` would print, as dicts.

    Raises:
        ValueError: a patch that matches no resource (by kind and name), or a kustomization field not implemented.
    """
    folder = Path(folder)
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    known = {"apiVersion", "kind", "namespace", "resources", "labels", "patches"}
    if set(k) - known:
        raise ValueError(f"{folder}: kustomization fields not rendered here: {sorted(set(k) - known)}")
    docs: list[dict] = []
    for item in k.get("resources", []):
        path = folder / item
        docs += render(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    if k.get("namespace"):
        for d in docs:
            if d["kind"] != "Namespace":
                d.setdefault("metadata", {})["namespace"] = k["namespace"]
    for labels in k.get("labels", []):
        for d in docs:
            d.setdefault("metadata", {}).setdefault("labels", {}).update(labels.get("pairs", {}))
    for patch in k.get("patches", []):
        p = yaml.safe_load((folder / patch["path"]).read_text())
        at = [i for i, d in enumerate(docs)
              if d["kind"] == p["kind"] and d["metadata"]["name"] == p["metadata"]["name"]]
        if len(at) != 1:
            raise ValueError(f"{folder / patch['path']}: matches {len(at)} resources")
        docs[at[0]] = _merge(docs[at[0]], p)
    return docs
