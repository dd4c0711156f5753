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


@pytest.mark.parametrize("name", ["v100-16gb", "v100-32gb", "a100-40gb", "a100-80gb", "h100-80gb"])
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
