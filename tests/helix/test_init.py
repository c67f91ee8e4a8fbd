"""``helix init`` writes a commented starter cluster that ``helix plan`` accepts as it is."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from helix.cli import main
from helix.profile import load_profiles_for
from helix.spec import load_cluster

ROOT = Path(__file__).resolve().parents[2]
TWO_REGIONS = ["init", "--gpus", "A100-80GB:2@us-east,L4:4@eu-west", "--model", "llama-2-70b"]


def flat(text: str) -> str:
    """Without whitespace: rich wraps long paths at 80 columns."""
    return "".join(text.split())


def run(capsys, argv: list[str]) -> tuple[int, str]:
    code = main(argv)
    captured = capsys.readouterr()
    text = " ".join((captured.out + captured.err).split())
    assert "Traceback" not in text
    return code, text


def test_init_then_plan_it_as_it_is(tmp_path, capsys) -> None:
    out = tmp_path / "my-cluster.yaml"
    code, text = run(capsys, [*TWO_REGIONS, "--kv-requests", "128", "-o", str(out)])
    assert code == 0, text
    assert "warning" not in text
    written = out.read_text()
    assert "docs/config.md" in written and "# EDIT" in written  # commented for the user
    cluster = load_cluster(out)
    assert [n.gpu for n in cluster.nodes] == ["A100-80GB"] * 2 + ["L4"] * 4
    assert {n.region for n in cluster.nodes} == {"us-east", "eu-west"} and cluster.coordinator.region == "us-east"
    assert cluster.defaults is not None and cluster.defaults.inter_region is not None
    assert cluster.profile_paths() == [tmp_path / "my-cluster-profiles.yaml"]
    assert load_profiles_for(cluster).models["llama-2-70b"].num_layers == 80
    code, text = run(capsys, ["plan", str(out), "--time-limit", "3", "-o", str(tmp_path / "plan.json")])
    assert code == 0, text
    assert set(yaml.safe_load((tmp_path / "plan.json").read_text())["placement"]) <= set(cluster.node_ids)


def test_one_region_has_no_inter_region_link(tmp_path, capsys) -> None:
    out = tmp_path / "c.yaml"
    code, text = run(capsys, ["init", "--gpus", "t4:2,L4", "--model", "SmolLM2-135M", "-o", str(out)])
    assert code == 0, text
    cluster = load_cluster(out)
    assert cluster.defaults is not None and cluster.defaults.inter_region is None
    assert [(n.id, n.gpu, n.region) for n in cluster.nodes] == [("t4-0", "T4", None), ("t4-1", "T4", None), ("l4-0", "L4", None)]
    assert cluster.model == "smollm2-135m"  # the names the estimate writes into the profiles
    assert run(capsys, ["plan", str(out), "--method", "petals"])[0] == 0


def test_init_with_shipped_profiles(tmp_path, capsys) -> None:
    profiles = ROOT / "clusters" / "helix-paper-single24" / "profiles-llama70b.yaml"
    out = tmp_path / "paper.yaml"
    argv = ["init", "--gpus", "A100:5,L4:4", "--model", "llama-2-70b", "--profiles", str(profiles), "-o", str(out)]
    code, text = run(capsys, argv)
    assert code == 0, text
    assert not (tmp_path / "paper-profiles.yaml").exists()
    cluster = load_cluster(out)
    assert cluster.profile_paths()[0].resolve() == profiles.resolve()
    code, text = run(capsys, ["plan", str(out), "--method", "petals"])
    assert code == 0, text


def test_existing_files_are_kept_unless_forced(tmp_path, capsys) -> None:
    out = tmp_path / "mine.yaml"
    out.write_text("# my own work\n")
    code, text = run(capsys, [*TWO_REGIONS, "-o", str(out)])
    assert code == 2 and "mine.yaml:exists;give--force" in flat(text)
    assert out.read_text() == "# my own work\n" and not (tmp_path / "mine-profiles.yaml").exists()
    (tmp_path / "other.yaml").unlink(missing_ok=True)
    (tmp_path / "other-profiles.yaml").write_text("# my profiles\n")
    code, text = run(capsys, [*TWO_REGIONS, "-o", str(tmp_path / "other.yaml")])
    assert code == 2 and "other-profiles.yaml:exists" in flat(text) and not (tmp_path / "other.yaml").exists()
    code, text = run(capsys, [*TWO_REGIONS, "--kv-requests", "128", "-o", str(out), "--force"])
    assert code == 0, text
    assert load_cluster(out).model == "llama-2-70b"


def test_a_cluster_that_cannot_hold_the_model_is_written_with_a_plain_warning(tmp_path, capsys) -> None:
    out = tmp_path / "small.yaml"
    code, text = run(capsys, [*TWO_REGIONS, "-o", str(out)])  # default KV reserve: 2 x 25 + 4 x 7 < 80 layers
    assert code == 0
    assert "warning: helix plan will refuse it as it is" in text and "at most 78" in text and "--kv-requests" in text
    code, text = run(capsys, ["plan", str(out)])
    assert code == 3 and "at most 78" in text


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["--gpus", "L4:x", "--model", "llama-2-7b"], ["--gpus", "GPU[:COUNT][@REGION]"]),
        (["--gpus", "B200:2", "--model", "llama-2-7b"], ["--gpus", "unknown GPU 'B200'", "A100-80GB"]),
        (["--gpus", "L4:2", "--model", "mistral-7b"], ["--model", "unknown model 'mistral-7b'", "llama-2-7b", "--profiles"]),
    ],
)
def test_bad_arguments_name_the_flag(tmp_path, capsys, argv: list[str], needles: list[str]) -> None:
    code, text = run(capsys, ["init", *argv, "-o", str(tmp_path / "c.yaml")])
    assert code == 2 and text.startswith("error:")
    for needle in needles:
        assert needle in text, (needle, text)
    assert "--model-config:" not in text
    assert not (tmp_path / "c.yaml").exists()
