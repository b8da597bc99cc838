from __future__ import annotations

import re

import pytest
import torch

from mbtune.errors import WorkloadError
from mbtune.workloads import Workload, load_workload


@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_builtins_train_and_report_size(name):
    workload = load_workload(name, (("layers", 2),))
    model = workload.build()
    inputs, targets = workload.make_batch(3, torch.Generator().manual_seed(0))
    loss = workload.loss(model(inputs), targets)
    loss.backward()
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert workload.num_parameters() == sum(p.numel() for p in model.parameters())
    assert workload.flops_per_sample > 0


def test_gpt_dials_and_flops():
    workload = load_workload("gpt", (("layers", 3), ("d_model", 64), ("heads", 2), ("seq_len", 16), ("vocab", 100)))
    assert workload.num_blocks == 5  # embedding, 3 blocks, head
    assert workload.tokens_per_sample == 16
    inputs, _ = workload.make_batch(2, None)
    assert workload.build()(inputs).shape == (2, 16, 100)


def test_blocks_built_alone_match_the_whole_model():
    workload = load_workload("mlp", (("layers", 3), ("width", 16)))
    whole = workload.build(seed=7)
    part = workload.build([2, 3], seed=7)
    for a, b in zip(list(whole)[2:4], part):
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa, pb)


@pytest.mark.parametrize(("name", "message"), [
    ("bert", "unknown workload 'bert'"),
    ("no_such_module_xyz:factory", "cannot import workload module"),
    ("tests.fixtures.workloads:missing", "has no callable 'missing'"),
    ("tests.fixtures.workloads:not_a_workload", "returned int, not a Workload"),
    ("tests.fixtures.workloads:import_fails", "factory .* failed: ImportError"),
])
def test_bad_workloads_give_a_clear_error_listing_builtins(name, message):
    with pytest.raises(WorkloadError, match=message) as info:
        load_workload(name)
    if "not a Workload" not in message:
        assert "gpt, mlp" in info.value.one_line()


def test_unknown_option_lists_accepted_ones():
    with pytest.raises(WorkloadError, match="no option depth") as info:
        load_workload("gpt", (("depth", 2),))
    assert "layers" in info.value.one_line()


def test_invalid_option_value():
    with pytest.raises(WorkloadError, match="divisible"):
        load_workload("gpt", (("d_model", 10), ("heads", 3)))


def test_user_factory_contract():
    workload = load_workload("tests.fixtures.workloads:broken")
    assert isinstance(workload, Workload) and workload.num_blocks == 1


def test_a_typed_flops_figure_far_from_the_count_is_kept_with_a_warning():
    from mbtune.workloads.flops import flops_warning

    assert flops_warning("w", None, 1e9) is None and flops_warning("w", 1.2e9, None) is None
    assert flops_warning("w", 1.05e9, 1e9) is None
    assert flops_warning("w", 1.2e9, 1e9) == (
        "workload 'w' says 1.2 GFLOP per sample, the counter 1 (+20%): MFU uses the workload's figure")


def test_options_convert_by_the_factorys_annotations():
    from mbtune.units import parse_options

    def got(*pairs: str) -> dict:
        return eval(load_workload("tests.fixtures.workloads:typed", parse_options(list(pairs))).description)

    assert got("bias=false", "width=16", "lr=1") == {"bias": False, "width": 16, "lr": 1.0, "name": None}
    for text, value in (("true", True), ("yes", True), ("1", True), ("No", False), ("0", False)):
        assert got(f"bias={text}")["bias"] is value
    assert got("name=none")["name"] is None and got("name=123")["name"] == "123"
    assert isinstance(got("lr=2")["lr"], float)


@pytest.mark.parametrize(("pair", "says"), [
    ("width=abc", "option width=abc is not an integer"), ("bias=maybe", "option bias=maybe is not true or false"),
    ("lr=fast", "option lr=fast is not a number"), ("bias=2", "option bias=2 is not true or false"),
])
def test_an_option_that_does_not_convert_is_bad_input_naming_it_and_the_type(pair, says):
    from mbtune.units import parse_options

    with pytest.raises(WorkloadError, match=re.escape(says)):
        load_workload("tests.fixtures.workloads:typed", parse_options([pair]))


def test_unannotated_options_are_passed_as_given():
    from mbtune.workloads.options import convert_options

    def factory(size, flag=True):  # noqa: ANN001, ANN202
        return None

    assert convert_options("w", factory, {"size": "big", "flag": "false"}) == {"size": "big", "flag": "false"}


def test_the_users_folder_comes_after_every_installed_package_on_the_import_path(tmp_path, monkeypatch):
    import shutil
    import sys
    from pathlib import Path

    shutil.copy(Path(__file__).parents[1] / "fixtures" / "user_workload.py", tmp_path / "userwl_here.py")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    installed = list(sys.path)
    assert load_workload("userwl_here:workload").num_blocks == 2
    assert sys.path == [*installed, str(tmp_path)]  # a checkout of mbtune here never shadows the installed one
