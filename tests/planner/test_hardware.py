"""The hardware catalogue."""

import pytest
import yaml

from ptdp.hardware import HardwareError, available_hardware, load_hardware, profile_from_dict


def test_catalogue_has_the_datasheet_gpus():
    names = set(available_hardware())
    assert {"v100-16gb", "v100-32gb", "a100-40gb", "a100-80gb", "h100-80gb"} <= names
    a100 = load_hardware("a100-80gb")
    assert a100.peak_flops("bf16") == 312e12          # L4101
    assert a100.memory_gb == 80 and a100.gpus_per_node == 8
    assert a100.nics_per_node == 8                     # 8 HDR cards per DGX A100 (L4088)
    assert load_hardware("v100-16gb").memory_gb == 16
    assert load_hardware("h100-80gb").peak_flops("bf16") > 3 * 312e12 * 0.9


@pytest.mark.parametrize("name", ["v100-16gb", "v100-32gb", "a100-40gb", "a100-80gb", "h100-80gb",
                                  "h200-141gb", "h100-94gb"])
def test_every_profile_is_complete(name):
    hw = load_hardware(name)
    assert hw.peak_flops(hw.default_precision) > 0
    assert hw.intra_node_bandwidth_GBps > hw.inter_node_bandwidth_GBps > 0


def test_unknown_name_suggests_the_closest():
    with pytest.raises(HardwareError, match="did you mean 'h100-80gb'"):
        load_hardware("h100-80")


def test_profile_from_a_path_and_bad_keys(tmp_path):
    raw = yaml.safe_load(open(load_hardware.__globals__["HARDWARE_DIR"] / "a100-40gb.yaml"))
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump({**raw, "name": "mine"}))
    assert load_hardware(str(path)).name == "mine"
    with pytest.raises(HardwareError, match="unknown hardware key"):
        profile_from_dict({**raw, "nvlink": 1})
    with pytest.raises(HardwareError, match="missing memory_gb"):
        profile_from_dict({k: v for k, v in raw.items() if k != "memory_gb"})


@pytest.mark.parametrize("extra,message", [
    ({"nvlink": 1}, "unknown hardware key(s) nvlink"),
    ({"efficiency": {"gemm_max": 0.7, "gemm_peak": 0.7}}, "unknown efficiency key(s) gemm_peak"),
    ({"measured": {"threads": 1, "heap_retension": 1.5}}, "unknown measured key(s) heap_retension")])
def test_a_profile_key_nothing_reads_is_refused_naming_file_and_key(tmp_path, extra, message):
    raw = yaml.safe_load(open(load_hardware.__globals__["HARDWARE_DIR"] / "a100-40gb.yaml"))
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump({**raw, **extra}))
    with pytest.raises(HardwareError) as err:
        load_hardware(str(path))
    assert str(err.value) == f"{path}: {message}"


def test_a_profile_knows_the_machine_it_was_measured_on():
    from ptdp.hardware import foreign_profile, machine_fingerprint
    here = machine_fingerprint()
    assert here["cpu_cores"] >= 1 and here["cpu"]
    datasheet = load_hardware("h100-80gb")
    assert foreign_profile(datasheet, here) is None          # nothing measured: no claim
    measured = load_hardware("h100-80gb")
    measured.measured = {"layers": []}
    assert "no fingerprint" in foreign_profile(measured, here)
    measured.fingerprint = dict(here)
    assert foreign_profile(measured, here) is None
    measured.fingerprint = {**here, "gpu": "NVIDIA H100 80GB HBM3", "gpus": 1}
    message = foreign_profile(measured, here)
    assert "1 x NVIDIA H100 80GB HBM3" in message and "differs in gpu, gpus" in message


def test_ptdp_plan_warns_about_a_foreign_profile(tmp_path, capsys):
    from ptdp.cli import main
    raw = yaml.safe_load(open(load_hardware.__globals__["HARDWARE_DIR"] / "a100-80gb.yaml"))
    elsewhere = {"cpu": "Some Other CPU", "cpu_cores": 128, "gpu": "NVIDIA A100-SXM4-80GB",
                 "gpus": 8, "torch": "2.0.0"}
    hw = tmp_path / "measured.yaml"
    hw.write_text(yaml.safe_dump({**raw, "measured": {"layers": []}, "fingerprint": elsewhere}))
    model = tmp_path / "m.yaml"
    model.write_text("model: {num_layers: 4, hidden_size: 256, num_heads: 8, seq_length: 128, "
                     "vocab_size: 1000}\n")
    assert main(["plan", str(model), "--hardware", str(hw), "--gpus", "8",
                 "--global-batch-size", "16", "--top", "1"]) == 0
    err = capsys.readouterr().err
    assert "was measured on 8 x NVIDIA A100-SXM4-80GB, Some Other CPU (128 cores)" in err


@pytest.mark.parametrize("name, gib, profile", [
    ("NVIDIA H100 80GB HBM3", 79.2, "h100-80gb"), ("NVIDIA H100 NVL", 93.1, "h100-94gb"),
    ("NVIDIA H200", 139.8, "h200-141gb"), ("NVIDIA A100-SXM4-40GB", 39.4, "a100-40gb"),
    ("NVIDIA A100-SXM4-80GB", 79.2, "a100-80gb"), ("NVIDIA L4", 22.0, None)])
def test_a_gpu_is_matched_to_its_profile_by_name_and_memory(name, gib, profile):
    """One matching (ptdp.hardware.profile_of_gpu) for the trainer's MFU and the GPU check."""
    from ptdp.hardware import profile_of_gpu
    assert profile_of_gpu(name, gib) == profile
