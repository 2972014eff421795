"""The engine's thread count: the CPUs the process may run on, capped by its
cgroup's CPU quota (a container's CPU limit), overridden by OMP_NUM_THREADS.

The real test puts a process into a real cgroup with a 1-CPU quota (cgroup v1
or v2, whichever this kernel mounts; it needs permission to create one, and
says so when it has none). The parsing tests read directory trees laid out as
the kernel lays out cgroupfs, for the version and layouts this machine does not
mount: a stand-in for the kernel's files, not for Folio's code."""

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from folio.worker.cpu_threads import affinity_cpus, cgroup_cpu_limit, default_threads, usable_cpus
from tests.utils import make_tiny_model


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_takes_the_smallest_quota_on_the_path(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("0::/kubepods/pod1/ctr\n")
    write(tmp_path, "fs/kubepods/cpu.max", "max 100000\n")
    write(tmp_path, "fs/kubepods/pod1/cpu.max", "250000 100000\n")        # 2.5 CPUs
    write(tmp_path, "fs/kubepods/pod1/ctr/cpu.max", "max 100000\n")
    assert cgroup_cpu_limit(str(tmp_path / "fs"), str(proc)) == 2.5
    write(tmp_path, "fs/kubepods/pod1/ctr/cpu.max", "50000 100000\n")
    assert cgroup_cpu_limit(str(tmp_path / "fs"), str(proc)) == 0.5


def test_in_a_container_the_mount_is_the_cgroup(tmp_path):
    # /proc names the host's path; the container sees its own cgroup at the root
    proc = tmp_path / "cgroup"
    proc.write_text("0::/kubepods.slice/pod-abc.slice/cri-containerd-1.scope\n")
    write(tmp_path, "fs/cpu.max", "400000 100000\n")
    assert cgroup_cpu_limit(str(tmp_path / "fs"), str(proc)) == 4.0


def test_cgroup_v1_quota_and_no_quota(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n")
    write(tmp_path, "fs/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "300000\n")
    write(tmp_path, "fs/cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_limit(str(tmp_path / "fs"), str(proc)) == 3.0
    write(tmp_path, "fs/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "-1\n")
    assert cgroup_cpu_limit(str(tmp_path / "fs"), str(proc)) is None
    assert cgroup_cpu_limit(str(tmp_path / "fs"), str(tmp_path / "missing")) is None


def test_the_quota_caps_the_cpus_rounded_down_and_never_below_one():
    cpus = affinity_cpus()
    assert usable_cpus(float(cpus + 8)) == cpus
    assert usable_cpus(None) == cpus
    assert usable_cpus(0.3) == 1
    if cpus >= 2:
        assert usable_cpus(1.9) == 1


def test_omp_num_threads_wins_and_a_bad_value_is_ignored():
    assert default_threads({"OMP_NUM_THREADS": "3"}) == (3, "OMP_NUM_THREADS")
    assert default_threads({"OMP_NUM_THREADS": "0"})[0] == usable_cpus(cgroup_cpu_limit())
    assert default_threads({"OMP_NUM_THREADS": "4,2"})[0] == usable_cpus(cgroup_cpu_limit())


def make_cpu_cgroup(name: str, cpus: float = 1.0):
    """A fresh cgroup with a quota of `cpus` CPUs: (directory, the file a
    process joins it by), or (None, the reason it cannot be made here). Also
    docs/bench/cpu_quota.py's."""
    root, quota = Path("/sys/fs/cgroup"), int(cpus * 100000)   # us per 100 ms period
    if (root / "cgroup.controllers").exists():              # v2
        if "cpu" not in (root / "cgroup.subtree_control").read_text().split():
            return None, "cgroup v2 without the cpu controller enabled for children"
        d, files = root / name, {"cpu.max": f"{quota} 100000"}
    else:
        v1 = next((root / m for m in ("cpu", "cpu,cpuacct") if (root / m).is_dir()), None)
        if v1 is None:
            return None, "no cgroup cpu controller mounted"
        d, files = v1 / name, {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": str(quota)}
    try:
        d.mkdir()
        for file, text in files.items():
            (d / file).write_text(text)
    except OSError as e:
        return None, f"cannot create a cgroup here: {e}"
    return d, d / "cgroup.procs"


def remove_cgroup(d: Path) -> None:
    for _ in range(50):
        try:
            d.rmdir()
            return
        except OSError:           # its last process is still exiting
            time.sleep(0.1)


@pytest.fixture
def one_cpu_cgroup():
    d, procs = make_cpu_cgroup(f"folio-test-{uuid.uuid4().hex[:8]}")
    if d is None:
        pytest.skip(procs)
    yield procs
    remove_cgroup(d)


def test_an_engine_in_a_one_cpu_container_runs_one_thread(one_cpu_cgroup, tmp_path):
    if affinity_cpus() < 2:
        pytest.skip("one CPU visible: a 1-CPU quota changes nothing to see")
    model = make_tiny_model(tmp_path / "m")
    script = ("from folio import LLM; from folio.env_report import collect; import torch; "
              f"LLM({model!r}, dtype='float32', num_kv_blocks=16); "
              "print(torch.get_num_threads()); print(collect()['threads'])")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    # the shell joins the cgroup, then becomes Python: nothing runs outside it
    out = subprocess.run(["sh", "-c", f'echo $$ > "{one_cpu_cgroup}" && exec "$0" -c "$1"',
                          sys.executable, script], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    threads, why = out.stdout.strip().splitlines()[-2:]
    assert threads == "1"
    assert why == f"1 (the cgroup's CPU quota of 1 CPUs ({affinity_cpus()} visible))"
