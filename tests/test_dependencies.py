"""pyproject.toml declares what is tested: the Lightning release the suite runs on (older ones
save last.ckpt at every epoch end and count loop steps differently), and no minimum below what
that release itself needs, and never a release known to be compromised."""

import re
from importlib.metadata import requires, version

import pytest
from conftest import REPO
from packaging.requirements import Requirement
from packaging.version import Version

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


# Lightning releases that were published compromised: credential-stealing code that runs on import
# (advisory GHSA-w37p-236h-pfx3, Lightning issue #21691). pip must never pick them.
COMPROMISED = {"lightning": ["2.6.2", "2.6.3"]}


@pytest.mark.parametrize(("name", "release"), [(n, r) for n, rs in COMPROMISED.items() for r in rs])
def test_a_compromised_release_is_excluded(name, release):
    assert Version(release) not in DECLARED[name].specifier, f"{DECLARED[name]} admits the compromised {name} {release}"
    assert Version(version(name)) != Version(release), (
        f"this environment has the compromised {name} {release} installed"
    )


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
