"""deploy/kustomize_lite.py: the strategic-merge subset and its refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.kustomize_lite import KustomizeError, render, strategic_merge


def test_merge_maps_lists_by_key_and_null_deletes() -> None:
    a1, a2, b3 = {"name": "A", "value": "1"}, {"name": "A", "value": "2"}, {"name": "B", "value": "3"}
    p1, p2 = {"containerPort": 1, "name": "x"}, {"containerPort": 2, "name": "x"}
    base = {"spec": {"containers": [{"name": "w", "env": [a1], "ports": [p1]}], "keep": 1, "drop": 2}}
    patch = {"spec": {"containers": [{"name": "w", "env": [a2, b3], "ports": [p2]}], "drop": None}}
    out = strategic_merge(base, patch)
    assert out == {"spec": {"containers": [{"name": "w", "env": [a2, b3], "ports": [p1, p2]}], "keep": 1}}
    assert base["spec"]["drop"] == 2  # the input is not modified
    assert strategic_merge({"args": ["a", "b"]}, {"args": ["c"]}) == {"args": ["c"]}


def _write(d: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)
    return d


CM = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\ndata: {x: '1'}\n"


def test_overlay_target_keeps_name_namespace_and_labels(tmp_path: Path) -> None:
    _write(tmp_path, {
        "base/kustomization.yaml": "resources: [cm.yaml]\nnamespace: ns1\n",
        "base/cm.yaml": CM,
        "over/kustomization.yaml": (
            "resources: [../base, ns.yaml]\nnamespace: ns2\nlabels: [{pairs: {p: q}}]\n"
            "patches: [{path: p.yaml, target: {kind: ConfigMap, name: a}}]\n"),
        "over/ns.yaml": "apiVersion: v1\nkind: Namespace\nmetadata: {name: ns2}\n",
        "over/p.yaml": "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: other}\ndata: {y: '2'}\n",
    })
    cm, ns = render(tmp_path / "over")
    assert cm["metadata"] == {"name": "a", "namespace": "ns2", "labels": {"p": "q"}}
    assert cm["data"] == {"x": "1", "y": "2"}
    assert "namespace" not in ns["metadata"]


@pytest.mark.parametrize(("kustomization", "needle"), [
    ("resources: [cm.yaml]\nconfigMapGenerator: []\n", "unsupported fields"),
    ("resources: [missing.yaml]\n", "does not exist"),
    ("resources: [cm.yaml]\npatches: [{patch: '{kind: ConfigMap, metadata: {name: zz}}'}]\n",
     "matches no resource"),
    ("resources: [cm.yaml]\nlabels: [{pairs: {a: b}, includeSelectors: true}]\n", "includeSelectors"),
])
def test_refuses_what_it_cannot_render(tmp_path: Path, kustomization: str, needle: str) -> None:
    _write(tmp_path, {"kustomization.yaml": kustomization, "cm.yaml": CM})
    with pytest.raises(KustomizeError, match=needle):
        render(tmp_path)


def test_no_kustomization_file(tmp_path: Path) -> None:
    with pytest.raises(KustomizeError, match=r"no kustomization\.yaml"):
        render(tmp_path)


def test_images_rewritten(tmp_path: Path) -> None:
    _write(tmp_path, {
        "kustomization.yaml": "resources: [p.yaml]\nimages: [{name: app, newName: reg/app, newTag: v2}]\n",
        "p.yaml": "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec: {containers: [{name: c, image: app},"
                  " {name: d, image: 'other:1'}]}\n",
    })
    (pod,) = render(tmp_path)
    assert [c["image"] for c in pod["spec"]["containers"]] == ["reg/app:v2", "other:1"]
