"""What each image installs: the distributions servedmodel's requirements pull in, and their size.

The operator image installs `servedmodel` (its core requirements), the simulator image
`servedmodel[sim]`. Given the requirement strings of a servedmodel wheel (its METADATA's Requires-Dist)
and the extras an image asks for, `closure()` walks them through the distributions installed in this
Python environment (the project venv, `make install`), markers and nested extras included. Nothing is
downloaded: tests/ship/test_images.py uses it to give a freshly installed wheel exactly the
dependencies its image would have (no more, so a missing requirement shows), and (requirements read
from pyproject.toml, as the images' wheel would say them)

    .venv/bin/python hack/image_closure.py

prints each image's distributions and installed size (the files pip would put in site-packages).
"""

from __future__ import annotations

import importlib.metadata as md
import sys
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

IMAGES = {"operator": (), "simulator": ("sim",)}


class MissingDistribution(LookupError):
    """A requirement that this environment does not have installed (run `make install`)."""


@dataclass
class Closure:
    """The distributions an install pulls in, by canonical name."""

    dists: dict[str, md.Distribution] = field(default_factory=dict)

    def files(self) -> list[tuple[Path, Path]]:
        """(path relative to site-packages, absolute path) of every installed file inside site-packages
        (console scripts in bin/ are left out: the image gets servedmodel's own from its install)."""
        out = []
        for dist in self.dists.values():
            for f in dist.files or []:
                if f.parts and f.parts[0] == "..":
                    continue
                out.append((Path(str(f)), Path(str(dist.locate_file(f)))))
        return out

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for _, p in self.files() if p.is_file())


def closure(requires: Iterable[str], extras: Iterable[str] = ()) -> Closure:
    """Every distribution `requires` (Requires-Dist strings, evaluated for `extras`) needs, transitively."""
    found = Closure()
    todo: list[tuple[Requirement, frozenset[str]]] = [
        (req, frozenset(extras)) for req in map(Requirement, requires)
    ]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        req, asked = todo.pop()
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in ("", *asked)):
            continue
        name = canonicalize_name(req.name)
        key = (name, frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            raise MissingDistribution(f"{req} is not installed here (make install)") from None
        found.dists[name] = dist
        todo += [(Requirement(r), frozenset(req.extras)) for r in dist.requires or []]
    return found


def pyproject_requires(pyproject: Path) -> list[str]:
    """Requires-Dist as a wheel built from this pyproject.toml would say it (extras as markers)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    out = list(project.get("dependencies", []))
    for extra, reqs in project.get("optional-dependencies", {}).items():
        for r in reqs:
            spec, _, marker = r.partition(";")
            out.append(
                f'{spec.strip()}; ({marker.strip()}) and extra == "{extra}"'
                if marker
                else f'{r}; extra == "{extra}"'
            )
    return out


def main() -> int:
    requires = pyproject_requires(Path(__file__).resolve().parents[1] / "pyproject.toml")
    print(f"{'image':<10} {'extras':<8} {'distributions':>13} {'installed MiB':>14}")
    for image, extras in IMAGES.items():
        c = closure(requires, extras)
        print(f"{image:<10} {','.join(extras) or '-':<8} {len(c.dists):>13} {c.size_bytes() / 2**20:>14.1f}")
    only_sim = sorted(set(closure(requires, ("sim",)).dists) - set(closure(requires).dists))
    print(f"simulator only: {', '.join(only_sim)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
