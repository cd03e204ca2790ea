"""A small offline renderer for the kustomize subset used by deploy/k8s (so CI needs no kubectl).

Supported kustomization.yaml fields (https://kubectl.docs.kubernetes.io/references/kustomize/kustomization/):
``resources`` (files, or directories holding a kustomization.yaml), ``namespace``, ``labels`` (pairs added
to ``metadata.labels`` only; ``includeSelectors`` must be false), ``images`` (``name`` → ``newName`` /
``newTag``) and ``patches`` (strategic-merge patches, ``path`` or inline ``patch``, optional ``target``
with ``kind`` / ``name``). Strategic merge, after the Kubernetes rules
(https://kubernetes.io/docs/tasks/manage-kubernetes-objects/update-api-object-kubectl-patch/): maps merge
recursively, a ``null`` value deletes the key, lists of maps merge by their merge key (``mountPath`` for
``volumeMounts``, ``containerPort`` for ``ports``, ``name`` otherwise), other lists are replaced. Any other
field raises, so the real kustomize and this renderer cannot silently disagree.

``python deploy/kustomize_lite.py DIR`` (or ``python -m deploy.kustomize_lite DIR``) prints the rendered
resources to stdout as YAML documents separated by ``---``, as ``kubectl kustomize DIR`` does.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

Resource = dict[str, Any]
SUPPORTED_FIELDS = frozenset({"apiVersion", "kind", "resources", "namespace", "labels", "images", "patches"})
CLUSTER_SCOPED = frozenset({"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                            "APIService", "PersistentVolume", "StorageClass"})
MERGE_KEYS = {"volumeMounts": "mountPath", "ports": "containerPort"}


class KustomizeError(ValueError):
    """A kustomization uses an unsupported field, names a missing file, or a patch matches nothing."""


def load_yaml_documents(path: Path) -> list[Resource]:
    """All non-empty YAML documents of ``path``. Raises ``KustomizeError`` if one is not a mapping."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    for d in docs:
        if not isinstance(d, dict):
            raise KustomizeError(f"{path}: a document is {type(d).__name__}, not a mapping")
    return docs


def strategic_merge(base: Any, patch: Any, key: str = "") -> Any:
    """Merge ``patch`` into a copy of ``base`` (the subset of strategic merge described above)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = strategic_merge(out[k], v, k) if k in out else copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list):
        mk = MERGE_KEYS.get(key, "name")
        if all(isinstance(i, dict) and mk in i for i in base + patch):
            merged = [copy.deepcopy(i) for i in base]
            index = {i[mk]: n for n, i in enumerate(merged)}
            for item in patch:
                if item[mk] in index:
                    merged[index[item[mk]]] = strategic_merge(merged[index[item[mk]]], item, key)
                else:
                    merged.append(copy.deepcopy(item))
            return merged
    return copy.deepcopy(patch)


def _matches(res: Resource, target: dict[str, Any]) -> bool:
    return all(res.get(f) == target[f] if f == "kind" else res["metadata"].get(f) == target[f]
               for f in ("kind", "name") if f in target)


def _apply_patch(resources: list[Resource], patch: Resource, target: dict[str, Any] | None, src: str) -> None:
    """Merge ``patch`` into every resource matching ``target`` (default: the patch's own kind and name).
    With an explicit target the patch's ``metadata.name`` is ignored: the target keeps its identity."""
    if target is None:
        target = {"kind": patch.get("kind"), "name": patch.get("metadata", {}).get("name")}
    else:
        patch = copy.deepcopy(patch)
        patch.get("metadata", {}).pop("name", None)
    hits = [n for n, r in enumerate(resources) if _matches(r, target)]
    if not hits:
        raise KustomizeError(f"{src}: patch target {target} matches no resource")
    for n in hits:
        resources[n] = strategic_merge(resources[n], patch)


def _set_images(node: Any, images: list[dict[str, str]]) -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "image" and isinstance(v, str):
                name, _, tag = v.partition(":")
                for img in images:
                    if img["name"] == name:
                        node[k] = f"{img.get('newName', name)}:{img.get('newTag', tag or 'latest')}"
            else:
                _set_images(v, images)
    elif isinstance(node, list):
        for item in node:
            _set_images(item, images)


def _load_resources(kdir: Path, entries: list[str]) -> list[Resource]:
    out: list[Resource] = []
    for entry in entries:
        path = (kdir / entry).resolve()
        if path.is_dir():
            out.extend(render(path))
        elif path.is_file():
            out.extend(load_yaml_documents(path))
        else:
            raise KustomizeError(f"{kdir}/kustomization.yaml: resource {entry!r} does not exist")
    return out


def render(kdir: Path) -> list[Resource]:
    """Render the kustomization in directory ``kdir`` to a list of resources (dicts).

    Raises:
        KustomizeError: missing kustomization.yaml or resource file, a field of the wrong shape (not a
            list of paths / of mappings), unsupported field, a patch that
            matches no resource, or ``labels`` with ``includeSelectors: true``.
    """
    kfile = kdir / "kustomization.yaml"
    if not kfile.is_file():
        raise KustomizeError(f"{kdir}: no kustomization.yaml")
    spec = yaml.safe_load(kfile.read_text()) or {}
    if not isinstance(spec, dict):
        raise KustomizeError(f"{kfile}: not a mapping of fields")
    for field in ("resources", "patches", "labels", "images"):
        items = spec.get(field, [])
        want = str if field == "resources" else dict
        if not isinstance(items, list) or not all(isinstance(x, want) for x in items):
            raise KustomizeError(f"{kfile}: {field} must be a list of "
                                 f"{'paths' if want is str else 'mappings'}, got {items!r}")
    if not isinstance(spec.get("namespace", ""), str):
        raise KustomizeError(f"{kfile}: namespace must be a string, got {spec['namespace']!r}")
    unknown = set(spec) - SUPPORTED_FIELDS
    if unknown:
        raise KustomizeError(f"{kfile}: unsupported fields {sorted(unknown)}")
    resources = _load_resources(kdir, spec.get("resources", []))
    for entry in spec.get("patches", []):
        src = f"{kfile} patch {entry.get('path', '<inline>')}"
        if "path" in entry:
            docs = load_yaml_documents(kdir / entry["path"])
        else:
            docs = [yaml.safe_load(entry["patch"])]
        for doc in docs:
            _apply_patch(resources, doc, entry.get("target"), src)
    for group in spec.get("labels", []):
        if group.get("includeSelectors", False):
            raise KustomizeError(f"{kfile}: labels.includeSelectors is not supported")
        for r in resources:
            r.setdefault("metadata", {}).setdefault("labels", {}).update(group["pairs"])
    _set_images(resources, spec.get("images", []))
    if "namespace" in spec:
        for r in resources:
            if r["kind"] not in CLUSTER_SCOPED:
                r["metadata"]["namespace"] = spec["namespace"]
    return resources


USAGE = "usage: python deploy/kustomize_lite.py DIR, a directory with a kustomization.yaml"


def main(argv: Sequence[str] | None = None) -> int:
    """Print the resources of the kustomization in ``argv``'s one directory as YAML documents separated by
    ``---`` (keys in the files' order). Returns 0; 2 after one line on stderr for a usage error (not
    exactly one argument, or one that is not a directory with a kustomization.yaml; ``-h``/``--help``
    prints the usage and returns 0); 1 after one line for a kustomization it cannot render
    (``KustomizeError``, a file that cannot be read or parsed)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if len(args) != 1 or args[0].startswith("-"):
        got = f"{len(args)} arguments: {' '.join(args)}" if len(args) != 1 else f"the option {args[0]}"
        print(f"kustomize_lite: error: expected one directory, got {got if args else 'none'} ({USAGE})",
              file=sys.stderr)
        return 2
    kdir = Path(args[0])
    if not (kdir / "kustomization.yaml").is_file():
        print(f"kustomize_lite: error: {kdir} is not a directory with a kustomization.yaml ({USAGE})",
              file=sys.stderr)
        return 2
    try:
        resources = render(kdir)
    except (KustomizeError, OSError, yaml.YAMLError) as exc:
        print(f"kustomize_lite: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    sys.stdout.write(yaml.safe_dump_all(resources, sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
