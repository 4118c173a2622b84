"""tools/dockerd-up's choice of storage driver, with stand-ins for dockerd, curl and mount.

No root and no Docker Engine: the stand-ins (on PATH first) record what the script asked for.
`dockerd` "answers" once it has written its driver to a state file; `mount` succeeds only when
OVERLAY_OK=1; `dockerd` refuses the drivers listed in FAIL_DRIVERS.
"""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "dockerd-up"

STUBS = {
    "id": 'echo 0\n',
    "debootstrap": 'exit 0\n',
    "mount": '[ "${OVERLAY_OK:-0}" = 1 ] || { echo "mount: unknown filesystem type" >&2; exit 32; }\n',
    "umount": 'exit 0\n',
    "mountpoint": 'exit 1\n',
    "dockerd": (
        'driver=""\n'
        'for a in "$@"; do case "$a" in --storage-driver=*) driver=${a#--storage-driver=} ;; esac; done\n'
        'echo "$driver" >> "$STATE/asked"\n'
        'case " ${FAIL_DRIVERS:-} " in *" $driver "*) echo "error initializing graphdriver: $driver" >&2; exit 1 ;; esac\n'
        'echo "$driver" > "$STATE/running"\n'
        'sleep 3\n'
    ),
    "curl": (
        'case "$*" in\n'
        '  */_ping*) [ -f "$STATE/running" ] ;;\n'
        '  */info*) printf \'{"Driver": "%s", "DockerRootDir": "%s"}\' "$(cat "$STATE/running")" "$STATE_ROOT" ;;\n'
        '  *) exit 22 ;;\n'
        'esac\n'
    ),
}


@pytest.fixture
def harness(tmp_path):
    bin_dir, state, root = tmp_path / "bin", tmp_path / "state", tmp_path / "docker-root"
    bin_dir.mkdir(), state.mkdir()
    for name, body in STUBS.items():
        stub = bin_dir / name
        stub.write_text("#!/bin/sh\n" + body)
        stub.chmod(0o755)
    sock = tmp_path / "docker.sock"
    with socket.socket(socket.AF_UNIX) as s:  # `[ -S ]` needs a real socket file
        s.bind(str(sock))
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "STATE": str(state),
        "STATE_ROOT": str(root), "DOCKER_SOCK": str(sock), "DOCKERD_LOG": str(tmp_path / "dockerd.log"),
        "DOCKERD_DATA_ROOT": str(root), "DOCKERD_UP_TIMEOUT": "10",
    }

    def run(**extra):
        proc = subprocess.run(["bash", str(SCRIPT)], env={**env, **extra}, capture_output=True, text=True,
                              timeout=60)
        asked = (state / "asked").read_text().split() if (state / "asked").exists() else []
        return proc, asked

    run.root, run.state = root, state
    return run


def test_overlay2_when_the_probe_mount_works_and_the_probe_is_cleaned_up(harness):
    proc, asked = harness(OVERLAY_OK="1")
    assert proc.returncode == 0, proc.stderr
    assert asked == ["overlay2"]
    assert "engine ready" in proc.stderr and "storage driver overlay2" in proc.stderr
    assert not list(harness.root.glob(".overlay-probe.*"))


def test_vfs_when_overlay_cannot_be_mounted(harness):
    proc, asked = harness(OVERLAY_OK="0")
    assert proc.returncode == 0, proc.stderr
    assert asked == ["vfs"]
    assert not list(harness.root.glob(".overlay-probe.*"))


def test_auto_falls_back_to_vfs_when_dockerd_refuses_overlay2(harness):
    proc, asked = harness(OVERLAY_OK="1", FAIL_DRIVERS="overlay2")
    assert proc.returncode == 0, proc.stderr
    assert asked == ["overlay2", "vfs"]
    assert "dockerd refused it; trying vfs" in proc.stderr


def test_forced_overlay2_refused_exits_1_and_names_the_vfs_command(harness):
    proc, asked = harness(OVERLAY_OK="1", FAIL_DRIVERS="overlay2", DOCKERD_STORAGE_DRIVER="overlay2")
    assert proc.returncode == 1
    assert asked == ["overlay2"]
    assert proc.stderr.rstrip().endswith("or run: sudo DOCKERD_STORAGE_DRIVER=vfs tools/dockerd-up")


def test_forced_vfs_skips_the_probe(harness):
    proc, asked = harness(OVERLAY_OK="1", DOCKERD_STORAGE_DRIVER="vfs")
    assert proc.returncode == 0, proc.stderr
    assert asked == ["vfs"]


def test_help_prints_the_header_and_starts_nothing(harness):
    proc = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and "DOCKERD_STORAGE_DRIVER" in proc.stdout
    assert not (harness.state / "asked").exists()


def test_unknown_driver_is_a_usage_error(harness):
    proc, asked = harness(DOCKERD_STORAGE_DRIVER="btrfs")
    assert proc.returncode == 2 and asked == []
    assert "not one of auto, overlay2, vfs" in proc.stderr and proc.stderr.rstrip().endswith("tools/dockerd-up")


def test_running_engine_is_kept_and_a_conflicting_force_is_refused(harness):
    (harness.state / "running").write_text("vfs\n")
    proc, asked = harness()
    assert proc.returncode == 0 and asked == []
    assert "engine already answers on" in proc.stderr and "(storage driver vfs, data root" in proc.stderr
    proc, asked = harness(DOCKERD_STORAGE_DRIVER="overlay2")
    assert proc.returncode == 2 and asked == []
    assert "does not match what was asked: storage driver overlay2 (it uses vfs)" in proc.stderr
    assert proc.stderr.rstrip().endswith("then run this command again.")


def test_layers_of_the_other_driver_are_reported(harness):
    (harness.root / "vfs" / "dir" / "layer").mkdir(parents=True)
    (harness.root / "vfs" / "dir" / "layer" / "f").write_bytes(b"x" * 4096)
    proc, _ = harness(OVERLAY_OK="1")
    assert proc.returncode == 0, proc.stderr
    assert "vfs layers that this overlay2 engine cannot see or prune" in proc.stderr
    assert f"remove {harness.root}/vfs and {harness.root}/image/vfs" in proc.stderr

