"""What rigctl makes of real nvidia-smi answers beyond the corpus's one-reader checks
(tests/fixtures/real/nvidia-smi-*): the probe of an R610 host, a MIG host and a unified-memory host, the
inventory's MIG pin rule, the instance environment's device order, and the server bench's memory slope
where the driver reports no memory."""

from __future__ import annotations

from pathlib import Path

import jinja2
import pytest
from inventory_support import edit_yaml

from rigctl.bench.server import MemoryPoint, kv_bytes_per_token
from rigctl.errors import ConfigError, ProbeError
from rigctl.fleet.host_facts import inventory_vars, parse_probe
from rigctl.hostside import nvidia_smi
from rigctl.inventory import Inventory
from rigctl.inventory.check import check

REPO = Path(__file__).resolve().parents[2]
REAL = REPO / "tests" / "fixtures" / "real"
ROLES = [REPO / "roles"]
TOKEN = "t0k3n"


def real(kind: str, name: str) -> str:
    """A recorded capture's output (its source line dropped)."""
    return (REAL / kind / name).read_text().partition("\n")[2]


def probe_output(gpus: str, smi: str, listing: str) -> str:
    """A probe's answer with these GPU sections and a plain x86 machine."""
    sections = {
        "gpus": gpus, "smi": "\n".join(smi.splitlines()[:12]), "list": listing,
        "cpu": "model name\t: AMD EPYC 7763 64-Core Processor\nflags\t\t: fpu sse4_2 avx avx2 fma f16c",
        "cpus": "16", "memory": "MemTotal:       131072000 kB",
        "disk": "/dev/sda1 100000000 1000000 99000000 2% /var/lib", "os": 'PRETTY_NAME="Ubuntu 24.04.3 LTS"',
    }
    return "".join(f"### {TOKEN} {name}\n{body}\n" for name, body in sections.items()) + f"### {TOKEN} end\n"


# The probe's --query-gpu=index,name,memory.total,compute_cap,driver_version,uuid,pci.bus_id line for the
# GPU of each recorded capture below, its values as that capture's own query answer reports them.
RTX_2080_SUPER_R610 = ("0, NVIDIA GeForce RTX 2080 SUPER, 8192, 7.5, 610.57.04, "
                       "GPU-00000000-0000-0000-0000-000000000000, 00000000:0C:00.0")
H100_MIG = "0, NVIDIA H100 80GB HBM3, 81559, 9.0, 590.48.01, GPU-00000000-0000-0000-0000-000000000000, 00000000:00:09.0"
# GB10: memory.total is [N/A] by design (nvitop#208's and marimo#6822's recorded answers).
GB10 = "0, NVIDIA GB10, [N/A], 12.1, 580.126.09, GPU-2dee1e25-b3b5-007e-2b55-79f2d0f2ebe5, 0000000F:01:00.0"


def test_an_r610_host_is_enrolled_with_its_driver_and_cuda() -> None:
    # R610 prints "KMD Version: 610.57.04  CUDA UMD Version: 13.3": before, `hosts add` refused the host.
    smi = real("nvidia-smi-summary", "exporter__linux-x86_64__nvidia-geforce-rtx-2080-super__610.57.04__idle.txt")
    listing = real("nvidia-smi-list", "exporter__linux-x86_64__nvidia-geforce-rtx-2080-super__610.57.04.txt")
    facts = parse_probe("r610", probe_output(RTX_2080_SUPER_R610, smi, listing), TOKEN)
    assert (facts.driver_version, facts.cuda_version) == ("610.57.04", "13.3")
    assert facts.gpus[0].vram_mib == 8192 and facts.gpus[0].mig == ()


def test_a_mig_host_records_its_instances() -> None:
    smi = real("nvidia-smi-summary", "exporter__linux-x86_64__nvidia-h100-mig__590.48.01__idle.txt")
    listing = real("nvidia-smi-list", "exporter__linux-x86_64__nvidia-h100-mig__590.48.01.txt")
    facts = parse_probe("mig", probe_output(H100_MIG, smi, listing), TOKEN)
    gpu = inventory_vars(facts)["gpu_host_gpu"]
    assert [m["profile"] for m in gpu["mig"]] == ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]
    assert gpu["mig"][0] == {"device": 0, "profile": "3g.40gb", "uuid": "MIG-00000000-0000-0000-0000-000000000000"}


def test_a_unified_memory_gpu_is_recorded_with_the_hosts_memory() -> None:
    smi = real("nvidia-smi-summary", "arctictraining-345__gb10-unified-memory__580.126.09.txt")
    facts = parse_probe("spark", probe_output(GB10, smi, "GPU 0: NVIDIA GB10 (UUID: "
                                                        "GPU-2dee1e25-b3b5-007e-2b55-79f2d0f2ebe5)"), TOKEN)
    assert facts.gpus[0].unified_memory and facts.gpus[0].vram_mib is None
    gpu = inventory_vars(facts)["gpu_host_gpu"]
    # The VRAM checks use what the platform offers the GPU: the host's memory.
    assert gpu["unified_memory"] is True and gpu["vram_mib"] == facts.memory_mib == 128000


def test_a_cuda_version_the_driver_cannot_report_is_refused_naming_the_field() -> None:
    # WSL2 with a broken CUDA library prints "CUDA Version: ERR!": nothing CUDA can run there.
    smi = real("nvidia-smi-summary", "wsl-11589__wsl2-rtx-3060-laptop-cuda-err__546.80.txt")
    line = "0, NVIDIA GeForce RTX 3060 Laptop GPU, 6144, 8.6, 546.80, GPU-00000000-0000-0000-0000-000000000000, " \
           "00000000:01:00.0"
    with pytest.raises(ProbeError, match="cuda_version"):
        parse_probe("wsl", probe_output(line, smi, ""), TOKEN)


MIG_UUID = "MIG-00000001-0000-0000-0000-000000000001"


def _mig_laptop(data: dict, pin: object) -> None:
    data["gpu_host_gpu"]["mig"] = [
        {"device": 0, "profile": "3g.40gb", "uuid": "MIG-00000000-0000-0000-0000-000000000000"},
        {"device": 1, "profile": "2g.20gb", "uuid": MIG_UUID}]
    data["llama_server_instances"] = {"gemma": {"artifact": "gemma-4-e2b-qat-q4_0", "profile": "rig", "port": 8081,
                                                "gpu": pin}}


def errors(inv: Path) -> list[str]:
    return [str(p) for p in check(Inventory.load(inv), ROLES) if p.severity == "error"]


def test_an_instance_on_a_mig_gpu_is_pinned_by_mig_uuid(rigs: Path) -> None:
    host_vars = rigs / "host_vars/laptop-1650ti.yml"
    edit_yaml(host_vars, lambda d: _mig_laptop(d, MIG_UUID))
    assert errors(rigs) == []
    assert Inventory.load(rigs).host("laptop-1650ti").server("gemma").gpu == MIG_UUID
    # An index names no device CUDA can use on a GPU with MIG on: refused, naming the instances.
    edit_yaml(host_vars, lambda d: _mig_laptop(d, 0))
    assert errors(rigs) == [
        "host laptop-1650ti: llama_server_instances.gemma.gpu: GPU 0 has MIG on: pin the instance to one of its "
        f"MIG instances by UUID (MIG-00000000-0000-0000-0000-000000000000, {MIG_UUID})"]
    edit_yaml(host_vars, lambda d: _mig_laptop(d, "MIG-99999999-0000-0000-0000-000000000000"))
    assert errors(rigs)[0].endswith("MIG-99999999-0000-0000-0000-000000000000 is not a MIG instance of this host's "
                                    f"GPUs (MIG-00000000-0000-0000-0000-000000000000, {MIG_UUID})")


@pytest.mark.parametrize("pin", [1, MIG_UUID])
def test_a_pinned_instance_counts_gpus_in_pci_bus_order(pin: object) -> None:
    # nvidia-smi's indexes follow the PCI bus; CUDA's default order is fastest first. The pin must say which.
    template = (REPO / "roles" / "llama_server/templates/etc/llama-server/instance.env.j2").read_text()
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    env.filters["comment"] = lambda text: f"# {text}"
    lines = env.from_string(template).render(item={"name": "gemma", "gpu": pin}, ansible_managed="managed").splitlines()
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in lines and f"CUDA_VISIBLE_DEVICES={pin}" in lines
    unpinned = env.from_string(template).render(item={"name": "gemma", "gpu": None}, ansible_managed="managed")
    assert not [line for line in unpinned.splitlines() if line.startswith("CUDA_")]


def test_the_memory_slope_skips_sizes_the_driver_reports_no_memory_for() -> None:
    # A unified-memory GPU answers memory.used with [N/A]: read as not reported, never a crash.
    assert [nvidia_smi.whole(r["memory.used"]) for r in nvidia_smi.query_rows("[N/A]\n", ["memory.used"])] == [None]
    assert kv_bytes_per_token([MemoryPoint(1024, None), MemoryPoint(2048, None)]) is None
    slope = kv_bytes_per_token([MemoryPoint(1024, 1000), MemoryPoint(2048, 1016), MemoryPoint(4096, None)])
    assert slope == pytest.approx(16 * 1024 * 1024 / 1024)


def test_a_bench_uses_the_gpus_it_names_and_refuses_a_mig_gpu(rigs: Path) -> None:
    from rigctl.bench.matrix import bench_job_spec, parse_spec

    spec = parse_spec({"hosts": ["laptop-1650ti"], "models": ["gemma-4-e2b-qat-q4_0"], "gpus": [0]}, "spec")
    host = Inventory.load(rigs).host("laptop-1650ti")
    assert bench_job_spec(host, spec).params["gpus"] == [0]
    with pytest.raises(ConfigError, match=r"laptop-1650ti: bench gpus: GPU 1 does not exist \(nvidia-smi indexes 0\)"):
        bench_job_spec(host, spec.model_copy(update={"gpus": [1]}))
    edit_yaml(rigs / "host_vars/laptop-1650ti.yml", lambda d: _mig_laptop(d, MIG_UUID))
    with pytest.raises(ConfigError, match="host laptop-1650ti: bench gpus: GPU 0 has MIG on"):
        bench_job_spec(Inventory.load(rigs).host("laptop-1650ti"), spec)


def test_an_unreadable_gpu_listing_is_refused_naming_the_line() -> None:
    smi = real("nvidia-smi-summary", "exporter__linux-x86_64__nvidia-geforce-rtx-2080-super__610.57.04__idle.txt")
    with pytest.raises(ProbeError, match="gpus.mig: nvidia-smi -L line 1: 'GPU 0 is lost' is neither"):
        parse_probe("r610", probe_output(RTX_2080_SUPER_R610, smi, "GPU 0 is lost"), TOKEN)
