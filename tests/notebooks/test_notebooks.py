"""Both notebooks execute top to bottom (nbclient, a real kernel) and produce their figures."""

from __future__ import annotations

from pathlib import Path

import nbclient
import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = {"placement.ipynb": 2, "compare.ipynb": 2}  # notebook -> figures it must produce


def _images(nb) -> int:  # noqa: ANN001 - nbformat node
    return sum(
        1
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if "image/png" in out.get("data", {})
    )


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_notebook_executes_and_draws(name: str) -> None:
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "notebooks")}}
    )
    client.execute()
    errors = [out for cell in nb.cells for out in cell.get("outputs", []) if out.get("output_type") == "error"]
    assert not errors
    assert _images(nb) >= NOTEBOOKS[name], f"{name} drew {_images(nb)} figures"


def test_placement_notebook_takes_any_cluster_and_plan(tmp_path: Path) -> None:
    """The parameters cell is honoured: the demo cluster with a plan made here."""
    from helix.profile import load_profiles_for
    from helix.spec import load_cluster
    from planner.api import make_plan

    cluster_path = ROOT / "clusters" / "demo" / "cluster.yaml"
    cluster = load_cluster(cluster_path)
    plan = make_plan(cluster, load_profiles_for(cluster), method="petals")
    plan.save(tmp_path / "plan.json")
    nb = nbformat.read(ROOT / "notebooks" / "placement.ipynb", as_version=4)
    params = next(c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", []))
    params.source = f"CLUSTER = {str(cluster_path)!r}\nPLAN = {str(tmp_path / 'plan.json')!r}\n"
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()  # fmt: skip
    assert _images(nb) >= 2
