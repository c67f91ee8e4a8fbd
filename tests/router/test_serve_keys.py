"""``helix serve``'s start-up checks of the cluster's CURVE keys and of where agents send tokens
(in process, before any socket opens; the keys in use with real agents: tests/node_agent/test_curve.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from helix.cli import main
from helix.profile import load_profiles_for
from helix.spec import load_cluster
from planner.api import finish_plan


def _serve(cluster: Path, plan: Path, *extra: str) -> list[str]:
    return ["serve", "--cluster", str(cluster), "--plan", str(plan), "--port", "0", *extra]


def test_serve_names_a_missing_key_and_an_unreachable_sink(demo_cluster: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    cluster = load_cluster(demo_cluster)
    plan = tmp_path / "plan.json"
    finish_plan(cluster, load_profiles_for(cluster), {"cpu-0": (0, 30)}, method="manual").save(plan)
    raw = yaml.safe_load(demo_cluster.read_text())
    raw["profiles"] = str(demo_cluster.parent / raw["profiles"])
    keyed = tmp_path / "keyed.yaml"
    keyed.write_text(yaml.safe_dump({**raw, "keys_dir": "keys"}, sort_keys=False))
    assert main(["keys", str(tmp_path / "keys"), "--cluster", str(keyed)]) == 0
    capsys.readouterr()
    (tmp_path / "keys" / "coordinator.key_secret").unlink()
    assert main(_serve(keyed, plan)) == 2
    assert "give 'coordinator' its secret certificate (--key FILE" in capsys.readouterr().err.replace("\n", "")
    assert main(_serve(keyed, plan, "--key", str(tmp_path / "keys" / "cpu-0.key_secret"))) == 2
    assert "this key pair is not 'coordinator''s" in capsys.readouterr().err.replace("\n", "")

    raw["coordinator"].pop("address")
    remote = tmp_path / "remote.yaml"
    remote.write_text(yaml.safe_dump(raw, sort_keys=False))
    assert main(_serve(remote, plan, "--agent", "cpu-0=tcp://10.0.0.7:5555")) == 2
    err = capsys.readouterr().err.replace("\n", "")
    assert "coordinator.address: agents cpu-0 are on other hosts" in err and "would bind 127.0.0.1" in err
