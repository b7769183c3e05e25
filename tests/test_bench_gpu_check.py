"""The GPU check's CPU dry run: the same steps as on a lent GPU (environment, the GPU tests on the CPU, the tiny
model's decode eager and with graphs, the DeepSeek-V3 layer benchmark at tiny sizes and its fitted profile), so
the script that runs on a GPU a few minutes a month cannot rot in between."""

from __future__ import annotations

import json

import pytest
import torch

from nanocp.bench import gpu_check
from nanocp.bench.latency_profile import LatencyProfile


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    code = gpu_check.main(["--dry-run", "--out", str(out)])
    return code, out, json.loads((out / "gpu_check.json").read_text())


def test_every_step_of_the_dry_run_succeeds(dry_run):
    code, out, result = dry_run
    assert {k: v["status"] for k, v in result["steps"].items()} == dict.fromkeys(gpu_check.STEPS, "ok")
    assert code == 0 and result["dry_run"]
    assert "CPU dry run" in (out / "gpu_check.md").read_text()
    assert (out / "gpu_check.log").read_text().count("=====") == 2 * len(gpu_check.STEPS)


def test_the_gpu_tests_ran_on_the_cpu(dry_run):
    tests = dry_run[2]["steps"]["tests"]
    ran = {c["test"].split("::")[0] for c in tests["cases"] if c["outcome"] == "passed"}
    assert {"tests.test_gpu_graphs", "tests.test_gpu_decode", "tests.test_kernels_routing"} <= ran
    assert tests["counts"]["failed"] == tests["counts"]["error"] == 0


def test_decode_rates_for_eager_and_graphs(dry_run):
    rows = dry_run[2]["steps"]["decode"]["rows"]
    assert {r["mode"] for r in rows} == {"eager", "graphs"}
    assert all(r["decode_tokens_per_s"] > 0 and r["end_to_end_tokens_per_s"] > 0 for r in rows)


def test_the_layer_step_writes_a_loadable_profile(dry_run):
    _, out, result = dry_run
    profiles = [f for f in result["steps"]["layer"]["files"] if f.endswith("deepseek-v3.json")]
    assert len(profiles) == 1
    profile = LatencyProfile.load(out / profiles[0])
    assert profile.kind == "measured"


def test_junit_outcomes_reads_every_outcome(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite><testcase classname="t" name="a"/>'
        '<testcase classname="t" name="b"><failure message="boom&#10;more">x</failure></testcase>'
        '<testcase classname="t" name="c"><skipped message="no GPU"/></testcase>'
        '<testcase classname="t" name="d"><error>bad fixture</error></testcase></testsuite></testsuites>'
    )
    assert gpu_check.junit_outcomes(xml) == [
        {"test": "t::a", "outcome": "passed", "reason": ""},
        {"test": "t::b", "outcome": "failed", "reason": "boom"},
        {"test": "t::c", "outcome": "skipped", "reason": "no GPU"},
        {"test": "t::d", "outcome": "error", "reason": "bad fixture"},
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer of a machine without CUDA")
def test_without_a_gpu_the_real_check_refuses_in_one_line(capsys):
    assert gpu_check.main(["--out", "unused"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--dry-run" in err


def test_bad_budget_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--dry-run", "--budget-s", "0"])
    assert e.value.code == 2 and "--budget-s must be > 0" in capsys.readouterr().err
