"""pyproject.toml declares what is tested: the Lightning release the suite runs on (older ones
save last.ckpt at every epoch end and count loop steps differently), and no minimum below what
that release itself needs."""

import re
from importlib.metadata import requires, version

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from conftest import REPO

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

DECLARED = {
    Requirement(spec).name: Requirement(spec)
    for spec in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
}


def minimum(requirement: Requirement) -> Version:
    (lowest,) = [Version(s.version) for s in requirement.specifier if s.operator in (">=", "==", "~=")]
    return lowest


def test_lightning_is_declared_as_the_minor_release_tested():
    tested = Version(version("lightning"))
    spec = DECLARED["lightning"].specifier
    assert tested in spec
    assert (minimum(DECLARED["lightning"]).major, minimum(DECLARED["lightning"]).minor) == (tested.major, tested.minor)
    assert Version(f"{tested.major}.{tested.minor - 1}.99") not in spec  # an untested older minor is refused


def test_no_minimum_is_below_what_lightning_itself_requires():
    # Lightning's own requirements, its CLI extra ("extra") included: jsonargparse, torchmetrics, torch.
    theirs = [Requirement(r) for r in requires("lightning") if "extra ==" not in r or re.search(r'extra == "extra"', r)]
    checked = 0
    for their in theirs:
        ours = DECLARED.get(their.name)
        if ours is None or not [s for s in ours.specifier if s.operator == ">="]:
            continue
        assert minimum(ours) in their.specifier, f"{ours} allows versions below Lightning's {their}"
        checked += 1
    assert checked >= 3  # torch, torchmetrics, jsonargparse


def test_every_installed_dependency_satisfies_the_declaration():
    for name, requirement in DECLARED.items():
        assert Version(version(name)) in requirement.specifier, f"installed {name} {version(name)} vs {requirement}"
