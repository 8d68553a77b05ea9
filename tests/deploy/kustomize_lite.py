"""`kubectl kustomize DIR` for the kustomize features deploy/k8s uses, in Python.

CI installs only what pip can (no kubectl or kustomize binary exists on PyPI for Linux; Debian
bookworm's kubernetes-client is kubectl 1.20, whose kustomize v2.0 predates `patches`). So the
tests render every kustomization with this module, and, wherever a kubectl or kustomize binary is
on PATH, also with the real thing and require the same objects.

Supported, with kustomize's semantics:
    resources   files (one or more YAML documents) and directories holding a kustomization
    patches     strategic-merge patches (`path:` or inline `patch:`), matched by the patch's own
                kind and name, or by `target:` {kind, name (a regular expression), labelSelector
                (key=value,...)}; merge keys as in the Kubernetes API for the lists used here
                (merged lists ordered as kustomize orders them); `null` deletes a field,
                `$patch: delete` a list element
    namespace   set on every namespaced object
    images      name -> newName / newTag / digest, in every containers/initContainers list
Anything else fails loudly (KustomizeError), as does a patch that matches nothing, a missing
file, or two objects with the same id.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import yaml

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_FIELDS = {"apiVersion", "kind", "resources", "patches", "namespace", "images"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "PersistentVolume",
                  "StorageClass", "PriorityClass", "RuntimeClass", "IngressClass"}
# List fields merged element by element (the patchMergeKey of the Kubernetes API types); every
# other list is replaced whole, as strategic merge does for atomic lists (args, tolerations).
MERGE_KEYS = {"containers": ("name",), "initContainers": ("name",), "volumes": ("name",),
              "volumeMounts": ("mountPath",), "env": ("name",), "imagePullSecrets": ("name",),
              "ports": ("containerPort", "port")}     # container ports, Service ports


class KustomizeError(ValueError):
    pass


def build(directory: str | Path) -> list[dict]:
    """The objects `kubectl kustomize directory` prints, in resource order."""
    directory = Path(directory)
    kfile = next((directory / n for n in KUSTOMIZATION_FILES if (directory / n).is_file()), None)
    if kfile is None:
        raise KustomizeError(f"{directory}: no kustomization file (looked for {', '.join(KUSTOMIZATION_FILES)})")
    k = yaml.safe_load(kfile.read_text()) or {}
    unknown = set(k) - SUPPORTED_FIELDS
    if unknown:
        raise KustomizeError(f"{kfile}: fields {sorted(unknown)} are not supported here (supported: "
                             f"{sorted(SUPPORTED_FIELDS)})")
    objects: list[dict] = []
    for entry in k.get("resources", []):
        path = directory / entry
        if "://" in entry or not path.exists():
            raise KustomizeError(f"{kfile}: resource {entry!r} is not a local file or directory")
        objects += build(path) if path.is_dir() else _load(path)
    _check_unique(objects, kfile)
    for i, p in enumerate(k.get("patches", [])):
        _apply_patch(objects, p, directory, f"{kfile}: patches[{i}]")
    if "namespace" in k:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj.setdefault("metadata", {})["namespace"] = k["namespace"]
    for image in k.get("images", []):
        _set_image(objects, image, kfile)
    _check_unique(objects, kfile)
    return objects


def _load(path: Path) -> list[dict]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    for d in docs:
        if not isinstance(d, dict) or not {"apiVersion", "kind", "metadata"} <= d.keys():
            raise KustomizeError(f"{path}: every document needs apiVersion, kind and metadata")
    return docs


def object_id(obj: dict) -> tuple[str, str, str, str]:
    group = obj["apiVersion"].rpartition("/")[0]
    return group, obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


def _check_unique(objects: list[dict], where) -> None:
    seen = set()
    for obj in objects:
        oid = object_id(obj)
        if oid in seen:
            raise KustomizeError(f"{where}: {oid} is defined twice")
        seen.add(oid)


# ---------------------------------------------------------------------------------------- patches

def _apply_patch(objects: list[dict], entry: dict, directory: Path, where: str) -> None:
    if set(entry) - {"path", "patch", "target"} or ("path" in entry) == ("patch" in entry):
        raise KustomizeError(f"{where}: needs exactly one of path/patch (and optionally target), got {sorted(entry)}")
    text = (directory / entry["path"]).read_text() if "path" in entry else entry["patch"]
    patch = yaml.safe_load(text)
    if not isinstance(patch, dict):
        raise KustomizeError(f"{where}: only strategic-merge patches (one mapping) are supported here")
    target = entry.get("target")
    if target is not None:
        unknown = set(target) - {"kind", "name", "labelSelector"}
        if unknown:
            raise KustomizeError(f"{where}: target fields {sorted(unknown)} are not supported here")
        matches = [o for o in objects if _selected(o, target)]
    else:
        matches = [o for o in objects if o["kind"] == patch.get("kind")
                   and o["metadata"]["name"] == patch.get("metadata", {}).get("name")]
    if not matches:
        raise KustomizeError(f"{where}: the patch matches no object (target {target or _name(patch)})")
    body = {k: v for k, v in patch.items() if k not in ("apiVersion", "kind", "metadata")}
    meta = {k: v for k, v in patch.get("metadata", {}).items() if k not in ("name", "namespace")}
    for obj in matches:
        merged = strategic_merge(obj, dict(body, metadata=meta) if meta else body)
        obj.clear()
        obj.update(merged)


def _name(obj: dict) -> str:
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


def _selected(obj: dict, target: dict) -> bool:
    if "kind" in target and obj["kind"] != target["kind"]:
        return False
    if "name" in target and not re.fullmatch(target["name"], obj["metadata"]["name"]):
        return False
    if "labelSelector" in target:
        labels = obj["metadata"].get("labels", {})
        for term in target["labelSelector"].split(","):
            key, sep, value = term.partition("=")
            if not sep or "!" in key:
                raise KustomizeError(f"labelSelector term {term!r}: only key=value terms are supported here")
            if labels.get(key.strip()) != value.strip():
                return False
    return True


def strategic_merge(base, patch):
    """A strategic-merge patch of `base` (not modified): maps merge key by key, `null` deletes a
    key, lists with a merge key merge element by element, other lists and scalars are replaced."""
    if not isinstance(patch, dict) or not isinstance(base, dict):
        return _plain(patch)
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if key.startswith("$"):
            raise KustomizeError(f"patch directive {key!r} is not supported here")
        if value is None:
            out.pop(key, None)
        elif key in out and isinstance(out[key], dict) and isinstance(value, dict):
            out[key] = strategic_merge(out[key], value)
        elif key in out and isinstance(out[key], list) and isinstance(value, list) and key in MERGE_KEYS:
            out[key] = _merge_list(key, out[key], value)
        else:
            out[key] = _plain(value)
    return out


def _merge_list(key: str, base: list, patch: list) -> list:
    """As kustomize (kyaml) orders it: the patch's elements first, in patch order (merged into the
    base element with the same key), then the base elements the patch does not name."""
    rest = copy.deepcopy(base)
    out = []
    for item in patch:
        mk = next((k for k in MERGE_KEYS[key] if isinstance(item, dict) and k in item), None)
        if mk is None:
            raise KustomizeError(f"patch of {key!r}: every element needs one of the merge keys {MERGE_KEYS[key]}")
        at = next((i for i, b in enumerate(rest) if isinstance(b, dict) and b.get(mk) == item[mk]), None)
        old = rest.pop(at) if at is not None else None
        if item.get("$patch") == "delete":
            continue
        out.append(_plain(item) if old is None else strategic_merge(old, item))
    return out + rest


def _plain(value):
    """A patch value placed where nothing was: its nulls dropped, no directives allowed."""
    if isinstance(value, dict):
        if any(k.startswith("$") for k in value):
            raise KustomizeError(f"patch directives in {value} are not supported here")
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


# ----------------------------------------------------------------------------------------- images

def _set_image(objects: list[dict], image: dict, kfile) -> None:
    unknown = set(image) - {"name", "newName", "newTag", "digest"}
    if unknown or "name" not in image:
        raise KustomizeError(f"{kfile}: images entry {image}: needs name; supported: newName, newTag, digest")
    for container in _containers(objects):
        ref = container.get("image", "")
        name, tag = _split_image(ref)
        if name != image["name"]:
            continue
        name = image.get("newName", name)
        if "digest" in image:
            tag = "@" + image["digest"]
        elif "newTag" in image:
            tag = ":" + str(image["newTag"])
        container["image"] = name + tag


def _split_image(ref: str) -> tuple[str, str]:
    """'registry:5000/app:1.0' -> ('registry:5000/app', ':1.0'); digests kept as '@sha256:...'."""
    if "@" in ref:
        name, _, digest = ref.partition("@")
        return name, "@" + digest
    slash = ref.rfind("/")
    colon = ref.rfind(":")
    if colon > slash:
        return ref[:colon], ref[colon:]
    return ref, ""


def _containers(node):
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                yield from (c for c in value if isinstance(c, dict))
            else:
                yield from _containers(value)
    elif isinstance(node, list):
        for value in node:
            yield from _containers(value)
