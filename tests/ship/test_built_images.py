"""The images hack/images.py built for real (`make images`): what their OCI archives say, and that they run.

Each archive's config must say what images/*/Containerfile asks for (entrypoint, user 1001, the ports,
HOME under /opt/app-root) and name the image as `ctr images import` will tag it. Its filesystem, unpacked
layer over layer into a scratch folder (hack/oci_archive.py), must keep /opt/app-root owned 1001:0 and
group-0 writable (OpenShift's arbitrary UID in group 0). Then, without a container runtime, the image's
own Python runs in a chroot of that folder as the image's user: the package imports from the image's
venv, the entrypoint starts, an arbitrary UID in group 0 can write HOME, and the simulator serves
/health and /v1/models on loopback.

Skipped, naming `make images`, when this checkout's images are not built (`make test` builds them:
images-or-skip); under SERVEDMODEL_REQUIRE_CLUSTER=1 (CI) that fails instead (tests/required.py).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import images  # hack/ is on sys.path (tests/conftest.py)
import oci_archive
from required import absent

APP_ROOT = "/opt/app-root"
# What each Containerfile asks for.
EXPECTED = {
    "operator": {
        "entrypoint": ["servedmodel", "run"],
        "cmd": None,
        "ports": {"8090/tcp", "8091/tcp"},
        "env": {"SERVEDMODEL_METRICS_PORT": "8090", "SERVEDMODEL_HEALTH_PORT": "8091"},
    },
    "simulator": {
        "entrypoint": ["servedmodel", "sim"],
        "cmd": ["Qwen/Qwen2.5-7B-Instruct", "--port", "8000"],
        "ports": {"8000/tcp"},
        "env": {},
    },
}
RUN_TIMEOUT_S = 120.0
SIM_START_TIMEOUT_S = 60.0


def images_missing(name: str) -> str | None:
    if images.built(name) is not None:
        return None
    return (
        f"the {name} image is not built for this checkout ({images.archive_path(name).name} missing "
        "in ~/.cache/servedmodel/images): run `make images` (hack/images.py)"
    )


@dataclass
class Built:
    name: str
    image: oci_archive.Image
    root: Path  # the unpacked filesystem

    @property
    def env(self) -> dict[str, str]:
        return dict(e.split("=", 1) for e in self.image.config["config"].get("Env", []))

    def run(
        self, *cmd: str, user: str = "1001:0", timeout: float = RUN_TIMEOUT_S
    ) -> subprocess.CompletedProcess[str]:
        """`cmd` in a chroot of the image's filesystem, as `user`, with the image's environment only."""
        return subprocess.run(
            self.chroot(*cmd, user=user), capture_output=True, text=True, timeout=timeout, check=False
        )

    def chroot(self, *cmd: str, user: str = "1001:0") -> list[str]:
        env = [f"{k}={v}" for k, v in self.env.items()]
        return ["chroot", f"--userspec={user}", str(self.root), "/usr/bin/env", "-i", *env, *cmd]


# Each image's archive as this session first found it: a change to the sources later in the session (a
# commit beside a running suite) changes the key, and would fail the rest of the module's tests.
_ARCHIVES: dict[str, Path] = {}


def _archive(name: str) -> Path:
    if name not in _ARCHIVES:
        archive = images.built(name)
        if archive is None:
            absent(images_missing(name) or name)
        _ARCHIVES[name] = archive
    return _ARCHIVES[name]


@pytest.fixture(scope="module", params=sorted(EXPECTED))
def config_of(request: pytest.FixtureRequest) -> tuple[str, oci_archive.Image]:
    name: str = request.param
    return name, oci_archive.read(_archive(name))


@pytest.fixture(scope="module")
def unpacked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Built]]:
    """Each image unpacked once per module, on first use (as root: owners and modes kept), for a chroot."""
    done: dict[str, Built] = {}
    yield done
    for one in done.values():
        shutil.rmtree(one.root, ignore_errors=True)


def _unpack(name: str, done: dict[str, Built], tmp_path_factory: pytest.TempPathFactory) -> Built:
    if name not in done:
        image = oci_archive.read(_archive(name))
        if os.geteuid() != 0 or shutil.which("chroot") is None:
            absent("running an image's filesystem needs root and chroot (owners kept on unpack)")
        root = tmp_path_factory.mktemp(f"{name}-rootfs")
        image.unpack(root)
        done[name] = Built(name, image, root)
    return done[name]


@pytest.fixture(params=sorted(EXPECTED))
def built(
    request: pytest.FixtureRequest, unpacked: dict[str, Built], tmp_path_factory: pytest.TempPathFactory
) -> Built:
    return _unpack(request.param, unpacked, tmp_path_factory)


@pytest.fixture
def simulator(unpacked: dict[str, Built], tmp_path_factory: pytest.TempPathFactory) -> Built:
    return _unpack("simulator", unpacked, tmp_path_factory)


def test_config_is_what_the_containerfile_asks(config_of: tuple[str, oci_archive.Image]) -> None:
    name, image = config_of
    want = EXPECTED[name]
    config = image.config["config"]
    assert image.reference == images.reference(name) == f"localhost/servedmodel/{name}:dev"
    assert config["Entrypoint"] == want["entrypoint"]
    assert config.get("Cmd") == want["cmd"]
    assert config["User"] == "1001"
    assert set(config["ExposedPorts"]) == want["ports"]
    assert config["WorkingDir"] == f"{APP_ROOT}/src"
    env = dict(e.split("=", 1) for e in config["Env"])
    assert env["HOME"] == f"{APP_ROOT}/src"
    assert f"{APP_ROOT}/bin" in env["PATH"].split(":")
    assert env.items() >= {"PYTHONUNBUFFERED": "1", **want["env"]}.items()
    assert image.config["os"] == "linux"
    assert image.layers
    assert all(layer.media_type.endswith("tar+gzip") for layer in image.layers)


def test_app_root_is_owned_by_1001_and_group_0_writable(built: Built) -> None:
    app_root = built.root / APP_ROOT.lstrip("/")
    wrong_owner, not_group_writable = [], []
    for path in [app_root, *app_root.rglob("*")]:
        st = path.lstat()
        rel = f"/{path.relative_to(built.root)}"
        if st.st_gid != 0:
            wrong_owner.append(f"{rel} gid {st.st_gid}")
        if stat.S_ISLNK(st.st_mode):
            continue
        # chmod g=u: the group (0, OpenShift's arbitrary UID is in it) may do what the owner may.
        if (st.st_mode >> 3) & 0o7 != (st.st_mode >> 6) & 0o7:
            not_group_writable.append(f"{rel} {stat.filemode(st.st_mode)}")
    assert not wrong_owner, wrong_owner[:20]
    assert not not_group_writable, not_group_writable[:20]
    for path in (app_root, app_root / "src", app_root / "bin" / "servedmodel"):
        assert path.lstat().st_uid == 1001, path


def test_the_package_imports_from_the_images_venv(built: Built) -> None:
    res = built.run("python", "-c", "import servedmodel, sys; print(servedmodel.__file__); print(sys.prefix)")
    assert res.returncode == 0, res.stderr
    where, prefix = res.stdout.split()
    assert where.startswith(f"{APP_ROOT}/lib/python3.11/site-packages/servedmodel/"), where
    assert prefix == APP_ROOT
    entry = built.image.config["config"]["Entrypoint"]
    help_ = built.run(*entry, "--help")
    assert help_.returncode == 0, help_.stderr
    assert "usage:" in help_.stdout
    if built.name == "operator":
        # The simulator's dependencies stay out of the operator image.
        sim = built.run("python", "-c", "import jinja2")
        assert sim.returncode != 0
        crd = built.run("servedmodel", "crd")
        assert crd.returncode == 0, crd.stderr
        assert "kind: CustomResourceDefinition" in crd.stdout


def test_an_arbitrary_uid_in_group_0_writes_home(built: Built) -> None:
    """OpenShift's restricted-v2 runs the container as a random UID with GID 0."""
    res = built.run(
        "sh",
        "-c",
        'touch "$HOME/probe" && mkdir -p "$HOME/.cache/x" && rm -r "$HOME/probe"',
        user="1000770000:0",
    )
    assert res.returncode == 0, res.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return int(resp.status), resp.read()


def test_the_simulator_serves_from_its_image(simulator: Built, tmp_path: Path) -> None:
    port = _free_port()
    config = simulator.image.config["config"]
    args = [*config["Entrypoint"], config["Cmd"][0], "--host", "127.0.0.1", "--port", str(port)]
    log = tmp_path / "simulator.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(simulator.chroot(*args), stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + SIM_START_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"the simulator exited {proc.returncode}: {log.read_text()[-3000:]}"
            try:
                status, _ = _get(f"http://127.0.0.1:{port}/health")
            except OSError:
                status = 0
            if status == 200:
                break
            assert time.monotonic() < deadline, (
                f"no /health in {SIM_START_TIMEOUT_S:.0f} s: {log.read_text()[-3000:]}"
            )
            time.sleep(0.5)
        status, body = _get(f"http://127.0.0.1:{port}/v1/models")
        assert status == 200
        assert [m["id"] for m in json.loads(body)["data"]] == [config["Cmd"][0]]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
