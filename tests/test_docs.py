"""The documentation stays true: the README's commands run, every link resolves, no large files."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SAMPLE, assert_same_outputs

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def _blocks(text: str, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if lang == language]


@pytest.fixture
def checkout_like(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder holding samples/models/tiny_cnn.onnx, as the commands expect."""
    models = tmp_path / "samples" / "models"
    models.mkdir(parents=True)
    shutil.copy(SAMPLE, models)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_readme_is_a_short_front_page() -> None:
    assert README.stat().st_size < 8 * 1024


def test_readme_example_commands_run(checkout_like: Path) -> None:
    commands = _blocks(_section(README.read_text(), "Example"), "sh")
    assert commands
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for line in commands[0].strip().splitlines():
        done = subprocess.run(
            line, shell=True, env=env, capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, f"{line}\n{done.stderr}"
    assert (checkout_like / "fusion_result.json").is_file()
    assert (checkout_like / "tiny_cnn_report.json").is_file()
    assert_same_outputs(SAMPLE, checkout_like / "tiny_cnn_opt.onnx")


def test_readme_python_example_runs(checkout_like: Path) -> None:
    (code,) = _blocks(_section(README.read_text(), "From Python"), "python")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert (checkout_like / "tiny_cnn_opt.onnx").is_file()
    assert "session_and_graph_id_0_0" in done.stdout


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_point_to_existing_files(page: Path) -> None:
    text = page.read_text()
    links = [link for link in LINK.findall(text) if not re.match(r"[a-z]+:", link)]
    for link in links:
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        assert path.exists(), f"{page.name}: {link} points to nothing"
        if anchor and path.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", path.read_text(), re.MULTILINE)
            slugs = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
            assert anchor in slugs, f"{page.name}: no heading for #{anchor} in {path.name}"


def test_no_large_tracked_file_outside_fixtures() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    names = [name for name in listed.stdout.decode().split("\0") if name]
    large = [
        name
        for name in names
        if not name.startswith("tests/fixtures/")
        and (ROOT / name).is_file()
        and (ROOT / name).stat().st_size > 2**20
    ]
    assert large == []
