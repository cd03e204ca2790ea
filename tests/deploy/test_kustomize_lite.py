"""deploy/kustomize_lite.py: the strategic-merge subset and its refusals; its command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy.kustomize_lite import KustomizeError, main, render, strategic_merge


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


def test_main_prints_the_rendered_overlay_as_kubectl_kustomize_does(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A new-user trial: ``python deploy/kustomize_lite.py deploy/k8s/overlays/cpu`` printed nothing and
    exited 0 (the module had no main)."""
    overlay = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "overlays" / "cpu"
    assert main([str(overlay)]) == 0
    out = capsys.readouterr().out
    assert list(yaml.safe_load_all(out)) == render(overlay)
    assert out.count("\n---\n") == len(render(overlay)) - 1


def test_main_as_a_script(tmp_path: Path) -> None:
    """Run as ``python deploy/kustomize_lite.py DIR`` (the script's directory first on sys.path)."""
    root = Path(__file__).resolve().parents[2]
    _write(tmp_path, {"kustomization.yaml": "resources: [cm.yaml]\nnamespace: ns1\n", "cm.yaml": CM})
    done = subprocess.run([sys.executable, str(root / "deploy" / "kustomize_lite.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert (done.returncode, done.stderr) == (0, "")
    want = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "a", "namespace": "ns1"},
            "data": {"x": "1"}}
    assert list(yaml.safe_load_all(done.stdout)) == [want]


@pytest.mark.parametrize(("args", "line", "code"), [
    ([], "kustomize_lite: error: expected one directory, got none (usage: ", 2),
    (["a", "b"], "kustomize_lite: error: expected one directory, got 2 arguments: a b (usage: ", 2),
    (["--out"], "kustomize_lite: error: expected one directory, got the option --out (usage: ", 2),
    (["{tmp}/nope"], "kustomize_lite: error: {tmp}/nope is not a directory with a kustomization.yaml", 2),
    (["{tmp}"], "kustomize_lite: error: {tmp} is not a directory with a kustomization.yaml", 2),
    (["{tmp}/bad"], "kustomize_lite: error: {tmp}/bad/kustomization.yaml: unsupported fields ['generators']",
     1),
    (["{tmp}/int"], "kustomize_lite: error: {tmp}/int/kustomization.yaml: resources must be a list of paths, "
     "got 5", 1),
    (["{tmp}/list"], "kustomize_lite: error: {tmp}/list/kustomization.yaml: not a mapping of fields", 1),
    (["{tmp}/patch"], "kustomize_lite: error: {tmp}/patch/kustomization.yaml: patches must be a list of "
     "mappings, got ['p.yaml']", 1),
])
def test_main_refuses_bad_arguments_in_one_line(args: list[str], line: str, code: int, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path, {"bad/kustomization.yaml": "resources: []\ngenerators: []\n",
                      "int/kustomization.yaml": "resources: 5\n", "list/kustomization.yaml": "- a\n",
                      "patch/kustomization.yaml": "patches: [p.yaml]\n"})
    assert main([a.format(tmp=tmp_path) for a in args]) == code
    captured = capsys.readouterr()
    [got] = captured.err.splitlines()
    assert got.startswith(line.format(tmp=tmp_path)) and captured.out == ""
    assert main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: python deploy/kustomize_lite.py DIR")
