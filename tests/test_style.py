"""The code's style is kept by ruff: `ruff check` with the configuration in pyproject.toml
([tool.ruff]) must find nothing in hvdtrain/, scripts/ and tests/. Run it yourself with
`.venv/bin/ruff check hvdtrain scripts tests` (`--fix` repairs what it can)."""
import subprocess

from helpers import BIN, REPO

CHECKED = ["hvdtrain", "scripts", "tests"]


def ruff_check(*paths) -> subprocess.CompletedProcess:
    ruff = BIN / "ruff"
    assert ruff.exists(), f"no {ruff}: install the test extra (pip install -e .[test] has ruff)"
    # --no-cache: nothing written into the checkout. The configuration is found from cwd.
    return subprocess.run([ruff, "check", "--no-cache", "--output-format", "concise", *paths], cwd=REPO,
                          capture_output=True, text=True)


def test_ruff_finds_nothing():
    proc = ruff_check(*CHECKED)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_reports_a_bad_file(tmp_path):
    """The check above can fail: with this configuration ruff flags an unused import and a line
    past the limit."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\nX = '" + "x" * 160 + "'\n")
    proc = ruff_check("--config", REPO / "pyproject.toml", bad)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "F401" in proc.stdout and "E501" in proc.stdout, proc.stdout
