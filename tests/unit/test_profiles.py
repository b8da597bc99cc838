from __future__ import annotations

import json

import pytest

from mbtune.errors import ProfileError
from mbtune.records import DeviceInfo
from mbtune.saving.profiles import SCHEMA_VERSION, device_slug, load_profile, profile_path, save_probe, slug
from tests.unit.test_records import sample_probe


def test_slugs_and_paths(tmp_path):
    gpu = DeviceInfo(backend="cuda", name="NVIDIA H200", index=0)
    assert device_slug(gpu) == "cuda-nvidia-h200"
    assert slug("pkg.mod:factory") == "pkg-mod-factory"
    assert profile_path(tmp_path, gpu, "gpt") == tmp_path / "cuda-nvidia-h200" / "gpt.json"


def test_save_then_load(tmp_path):
    path = save_probe(tmp_path, sample_probe(), "mbtune probe -w mlp")
    assert path == tmp_path / "cpu-test-cpu" / "mlp.json"
    profile = load_profile(path)
    assert profile.schema_version == SCHEMA_VERSION
    assert profile.probe == sample_probe()
    assert profile.metadata.command_line == "mbtune probe -w mlp"
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_corrupt_missing_and_newer_profiles_are_refused(tmp_path):
    path = save_probe(tmp_path, sample_probe(), "mbtune probe")
    good = path.read_text()
    path.write_text(good[: len(good) // 2])
    with pytest.raises(ProfileError, match="not readable JSON"):
        load_profile(path)
    assert path.read_text() == good[: len(good) // 2]  # reported, never overwritten
    newer = json.loads(good)
    newer["schema_version"] = SCHEMA_VERSION + 1
    path.write_text(json.dumps(newer))
    with pytest.raises(ProfileError, match="newer than this mbtune reads"):
        load_profile(path)
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile(tmp_path / "nope.json")


def test_unwritable_folder_is_a_clear_error_and_keeps_the_old_file(tmp_path):
    path = save_probe(tmp_path, sample_probe(), "first")
    before = path.read_text()
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a folder should be")  # unwritable even for root
    with pytest.raises(ProfileError, match="cannot write profile"):
        save_probe(blocker, sample_probe(), "second")
    assert path.read_text() == before


def test_older_schemas_are_migrated_or_refused(tmp_path, monkeypatch):
    import mbtune.saving.profiles as profiles

    path = save_probe(tmp_path, sample_probe(), "mbtune probe")
    data = json.loads(path.read_text())
    # Pretend the current schema is one newer and that it renamed "safe_batch" (a migration step's job).
    monkeypatch.setattr(profiles, "SCHEMA_VERSION", SCHEMA_VERSION + 1)

    def rename(old: dict) -> dict:
        old["probe"]["safe_batch"] = old["probe"].pop("old_safe_batch")
        return {**old, "schema_version": old["schema_version"] + 1}

    monkeypatch.setattr(profiles, "MIGRATIONS", {SCHEMA_VERSION: rename})
    data["probe"]["old_safe_batch"] = data["probe"].pop("safe_batch")
    path.write_text(json.dumps(data))
    assert load_profile(path).probe.safe_batch == sample_probe().safe_batch

    monkeypatch.setattr(profiles, "OLDEST_READABLE_SCHEMA", SCHEMA_VERSION + 1)
    with pytest.raises(ProfileError, match="older than this mbtune reads"):
        load_profile(path)


def test_a_version_2_profile_is_migrated_to_ranks_stages_per_rank_and_the_probes_training_settings(tmp_path):
    import json
    from dataclasses import replace

    from tests.unit.test_plan_api import profile as planned_profile
    from tests.unit.test_serve_records import sample_probe

    now = replace(planned_profile(), schema_version=SCHEMA_VERSION, probe=replace(sample_probe(), optimizer="sgd"))
    assert now.sweep is not None
    data = now.to_dict()
    data["schema_version"] = 2
    for row in data["sweep"]["results"]:
        point = row["point"]
        point["num_stages"], point["virtual_stages"] = point.pop("num_ranks"), point.pop("stages_per_rank")
        point["num_microbatches"] = point.pop("num_micro_batches")
    for name in ("precision", "optimizer", "lr"):
        del data["sweep"][name]
    (tmp_path / "v2.json").write_text(json.dumps(data))
    loaded = load_profile(tmp_path / "v2.json")
    assert loaded.schema_version == SCHEMA_VERSION
    assert [r.point for r in loaded.sweep.results] == [r.point for r in now.sweep.results]
    assert (loaded.sweep.optimizer, loaded.sweep.precision, loaded.sweep.lr) == ("sgd", "fp32", None)


def test_a_version_3_profile_and_journal_read_the_micro_batch_count_by_its_former_name(tmp_path):
    import json

    from mbtune.pipeline.point import SweepPoint
    from mbtune.sweeping.records import PointResult
    from tests.unit.test_plan_api import profile as planned_profile

    now = planned_profile()
    assert now.sweep is not None and now.sweep.results
    data = now.to_dict()
    data["schema_version"] = 3
    for row in data["sweep"]["results"]:
        row["point"]["num_microbatches"] = row["point"].pop("num_micro_batches")
    assert "num_micro_batches" not in json.dumps(data)
    (tmp_path / "v3.json").write_text(json.dumps(data))
    loaded = load_profile(tmp_path / "v3.json")
    assert loaded.schema_version == SCHEMA_VERSION == 4
    assert [r.point for r in loaded.sweep.results] == [r.point for r in now.sweep.results]
    # A journal's line (a PointResult as an older mbtune wrote it) loads through the same record.
    line = data["sweep"]["results"][0]
    assert PointResult.from_dict(line).point == now.sweep.results[0].point
    both = {**line["point"], "num_micro_batches": 99}  # where both are given, the current name wins
    assert SweepPoint.from_dict(both).num_micro_batches == 99
