"""Packaging: the wheel ships mlp_fuser (with mlp_fuser.patterns and py.typed) and nothing at the top level
besides it; the version lives in one place; the dependencies are ranges; the two commands and CI agree."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _source_packages() -> dict[str, Path]:
    """Every package the wheel must ship: the package-dir mapping, plus any subpackage found on disk."""
    mapping = PYPROJECT["tool"]["setuptools"]["package-dir"]
    found: dict[str, Path] = {}
    for pkg, d in mapping.items():
        base = ROOT / d
        for init in base.rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            rel = init.parent.relative_to(base)
            found[".".join((pkg, *rel.parts))] = init.parent
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """Build the wheel from a copy of the sources (never in the shared checkout)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for d in {Path(v).parts[0] for v in PYPROJECT["tool"]["setuptools"]["package-dir"].values()}:
        shutil.copytree(ROOT / d, src / d, ignore=ignore)
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src), "-w", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = out.glob("mlp_fuser-*.whl")
    return zipfile.ZipFile(whl)


def _metadata(wheel: zipfile.ZipFile):
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return Parser().parsestr(wheel.read(name).decode())


def test_wheel_ships_patterns_inside_the_package(wheel):
    names = set(wheel.namelist())
    shipped = {n for n in names if n.startswith("mlp_fuser/patterns/") and n.endswith(".py")}
    on_disk = {f"mlp_fuser/patterns/{p.name}" for p in (ROOT / "patterns").glob("*.py")}
    assert "mlp_fuser/patterns/__init__.py" in shipped
    assert shipped == on_disk
    assert not any(n.startswith("patterns/") for n in names), "a top-level patterns/ must not be shipped"


def test_wheel_top_level_is_mlp_fuser_only(wheel):
    tops = {n.split("/")[0] for n in wheel.namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"mlp_fuser"}
    (top_level,) = [n for n in wheel.namelist() if n.endswith(".dist-info/top_level.txt")] or [None]
    if top_level:
        assert wheel.read(top_level).decode().split() == ["mlp_fuser"]


def test_wheel_is_typed_and_complete(wheel):
    names = set(wheel.namelist())
    assert "mlp_fuser/py.typed" in names
    for pkg, d in _source_packages().items():
        prefix = pkg.replace(".", "/")
        for f in d.glob("*.py"):
            assert f"{prefix}/{f.name}" in names, f"{pkg}: {f.name} is not in the wheel (list it in pyproject.toml)"


def test_wheel_metadata(wheel):
    import mlp_fuser

    meta = _metadata(wheel)
    assert meta["Name"] == "mlp-fuser"
    assert meta["Version"] == mlp_fuser.__version__
    requires = meta.get_all("Requires-Dist")
    runtime = [r for r in requires if "extra ==" not in r]
    assert any(re.match(r"torch\s*>=\s*2\.11", r) for r in runtime), runtime
    assert any(r.startswith("triton") for r in runtime), runtime
    pinned = [r for r in runtime if "==" in r.split(";")[0]]
    assert not pinned, f"runtime dependencies must be ranges, not pins: {pinned}"
    assert set(meta.get_all("Provides-Extra")) >= {"hf", "test"}
    hf = [r for r in requires if 'extra == "hf"' in r]
    for dep in ("transformers", "accelerate", "gguf"):
        assert any(r.startswith(dep) for r in hf), hf
    ep = [n for n in wheel.namelist() if n.endswith("entry_points.txt")]
    assert ep and "mlp_fuser.cli:main" in wheel.read(ep[0]).decode()


def test_version_in_one_place():
    import mlp_fuser

    assert "version" not in PYPROJECT["project"], "the version is dynamic, read from mlp_fuser.__version__"
    assert "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "mlp_fuser.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+([.-]?\w+)?", mlp_fuser.__version__)
    defs = [
        p
        for d in ("mlp_fuser", "patterns", "benchmarks", "examples")
        if (ROOT / d).exists()
        for p in (ROOT / d).rglob("*.py")
        if re.search(r"^__version__\s*=", p.read_text(), re.M)
    ]
    assert [p.relative_to(ROOT).as_posix() for p in defs] == ["mlp_fuser/__init__.py"]


def test_installed_version_matches():
    from importlib.metadata import PackageNotFoundError, version

    import mlp_fuser

    try:
        assert version("mlp-fuser") == mlp_fuser.__version__
    except PackageNotFoundError:
        pytest.skip("mlp-fuser is not installed (running from the source tree)")


def test_patterns_import_as_subpackage():
    import mlp_fuser.patterns

    assert Path(mlp_fuser.patterns.__file__).resolve().parent in {ROOT / "patterns", ROOT / "mlp_fuser" / "patterns"}


def test_pyproject_tooling():
    assert "ruff" in PYPROJECT["tool"] and PYPROJECT["tool"]["ruff"]["lint"]["select"]
    pytest_cfg = PYPROJECT["tool"]["pytest"]["ini_options"]
    assert pytest_cfg["testpaths"] == ["tests"]
    assert "not slow" not in str(pytest_cfg.get("addopts", "")), "the suite (and CI) must run the slow tests"
    assert any(m.startswith("slow") for m in pytest_cfg["markers"])
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert any(d.startswith("ruff") for d in extras["test"]) and any(d.startswith("pytest") for d in extras["test"])


def test_readme_ci_and_run_agree():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    run = (ROOT / "run").read_text()
    assert "./run demo" in readme and "./run test" in readme
    assert re.search(r"^exec \./run test\s*$", ci, re.M), "CI runs exactly the README's test command"
    assert "## Benchmarks" in readme and "benchmarks/RESULTS.md" in readme
    # the test command lints, runs all of tests/ and treats pytest's exit 5 (no tests) as a failure
    assert "ruff check ." in run and "-m pytest" in run and "== 5" in run
    # a CPU machine gets the CPU torch first; the pins live in the script, not in the runtime dependencies
    assert "torch==2.13.0+cpu" in run and "triton==3.7.1" in run and "transformers==5.17.0" in run
    for f in (ROOT / "run", ROOT / ".ci" / "run"):
        assert f.stat().st_mode & 0o111, f"{f} must be executable"
