"""docs/config.md stays true to the models: its field tables are regenerated and compared, every
field has a description, and the worked example is what ``helix init`` writes and plans."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from pydantic import BaseModel, Field

from helix import reference
from helix.cli import main
from helix.reference import BLOCKS, END, model_table, models_of, update_document
from helix.reference import main as reference_main

ROOT = Path(__file__).resolve().parents[2]
CONFIG_MD = ROOT / "docs" / "config.md"
EXAMPLE = re.compile(r"<!-- example: (helix init [^\n]*) -->\n```yaml\n(.*?)```", re.S)


def test_config_md_field_tables_match_the_models() -> None:
    text = CONFIG_MD.read_text(encoding="utf-8")
    assert update_document(text) == text, "docs/config.md is stale: run python -m helix.reference docs/config.md"


@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_every_field_is_described_and_documented(block: str) -> None:
    text = CONFIG_MD.read_text(encoding="utf-8")
    for model in models_of(BLOCKS[block]):
        assert f"#### {model.__name__}\n" in text
        for name, info in model.model_fields.items():
            assert (info.description or "").strip(), f"{model.__name__}.{name} has no description= (the docs need one)"
            assert f"| `{name}` |" in text


def test_the_file_formats_reach_every_nested_model() -> None:
    names = {m.__name__ for root in BLOCKS.values() for m in models_of(root)}
    assert {"ClusterSpec", "CoordinatorSpec", "NodeSpec", "LinkSpec", "LinkDefaults", "LinkParams", "ProfileSet",
            "ModelProfile", "GpuProfile", "ThroughputProfile", "Plan", "FlowEdge", "TaskSpec", "PETFileConfig",
            "RegionSpec", "SteppingAlone"} == names


def test_a_table_row_says_type_constraints_default_and_meaning() -> None:
    class Link(BaseModel):
        """A link."""

        bandwidth_gbps: float = Field(gt=0, description="Gbit/s")
        latency_ms: float | None = Field(default=None, ge=0, description="ms")
        hops: list[tuple[int, int]] = Field(default=[], description="pairs")

    table = model_table(Link)
    assert "| `bandwidth_gbps` | number, > 0 | **required** | Gbit/s |" in table
    assert "| `latency_ms` | number, >= 0 | absent | ms |" in table
    assert "| `hops` | list of [integer, integer] | `[]` | pairs |" in table


def test_drift_is_found_and_prose_is_kept(tmp_path, monkeypatch, capsys) -> None:
    doc = tmp_path / "config.md"
    fresh = CONFIG_MD.read_text(encoding="utf-8")
    stale = fresh.replace("| `bandwidth_gbps` |", "| `bandwidth_mbps` |", 1) + "\nmy own closing words\n"
    doc.write_text(stale)
    assert reference_main(["--check", str(doc)]) == 1 and "stale" in capsys.readouterr().out
    assert doc.read_text() == stale  # --check only reads
    assert reference_main([str(doc)]) == 0
    assert doc.read_text() == fresh + "\nmy own closing words\n"
    assert reference_main(["--check", str(doc)]) == 0

    class Extra(BaseModel):
        newly_added: int = Field(default=1, description="a field the docs do not have yet")

    monkeypatch.setitem(reference.BLOCKS, "plan", Extra)
    assert "newly_added" not in fresh and "newly_added" in update_document(fresh)


def test_a_missing_block_is_an_error() -> None:
    text = CONFIG_MD.read_text(encoding="utf-8")
    without = text.replace(END.format(name="profiles"), "")
    with pytest.raises(ValueError, match="no generated block 'profiles'"):
        update_document(without)


def test_the_worked_example_is_what_helix_init_writes_and_it_plans(tmp_path, monkeypatch, capsys) -> None:
    match = EXAMPLE.search(CONFIG_MD.read_text(encoding="utf-8"))
    assert match is not None, "docs/config.md lost its worked example"
    command, shown = shlex.split(match.group(1)), match.group(2)
    monkeypatch.chdir(tmp_path)
    assert main(command[1:]) == 0
    out = Path(command[command.index("-o") + 1])
    assert out.read_text() == shown, "the worked example differs from what helix init writes: update docs/config.md"
    assert main(["plan", str(out), "--method", "petals"]) == 0
    assert "Traceback" not in capsys.readouterr().err
