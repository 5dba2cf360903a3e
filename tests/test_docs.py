"""The user docs run: every ```python block of README.md and docs/*.md is executed.

Each Markdown file is one test. Its python blocks run in order in one fresh namespace,
in a fresh Python process (so one file's imports, policies and seeds cannot leak into
another's), from a temporary working directory. A failing block reports the Markdown
file and line, because each block is compiled at its own line numbers under the file's
path.

A block may be skipped only when it needs a GPU or network access, with the reason in a
marker on the line right before its fence:

    <!-- docs-test: skip (needs a GPU) -->

Any other reason is an error, as is an unterminated fence. Signatures and other
non-runnable listings belong in ```text blocks.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# The migration guides must keep runnable examples: a guide whose blocks vanished (a
# renamed fence, a parser change) fails here instead of passing with nothing run.
MIN_BLOCKS = {
    "README.md": 5,
    "docs/migrate_from_tfa.md": 3,
    "docs/migrate_from_pytorch.md": 3,
    "docs/migrate_from_keras_embedding.md": 2,
}
# The two commands users and CI run (.ci/run) open the README, word for word.
README_COMMANDS = (
    "bash configure.sh && .venv/bin/python -m tf_ttemb demo\n"
    "bash configure.sh && .venv/bin/python -m pytest -q tests\n"
)
SKIP_MARKER = re.compile(r"^<!--\s*docs-test:\s*skip\s*\((?P<reason>[^)]*)\)\s*-->$")
ALLOWED_SKIP = re.compile(r"\b(GPU|network)\b", re.IGNORECASE)
FENCE = re.compile(r"^(?P<indent>\s*)(?P<ticks>`{3,})(?P<info>[^`]*)$")
# Seconds one file may take; the whole test file stays near a minute on 2 cores.
TIMEOUT_S = 300


@dataclass(frozen=True)
class Block:
    """One fenced code block: its language, first code line (1-based) and source."""

    language: str
    line: int
    code: str
    skip_reason: str | None


def extract_blocks(text: str, name: str = "<doc>") -> list[Block]:
    """The fenced code blocks of a Markdown text, in order.

    Raises:
        ValueError: An unterminated fence, or a skip marker whose reason does not say the
            block needs a GPU or network access.
    """
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, ticks = match["indent"], match["ticks"]
        language = match["info"].strip().split(" ")[0] if match["info"].strip() else ""
        start = i + 1
        j = start
        while j < len(lines) and lines[j].strip() != ticks:
            j += 1
        if j == len(lines):
            raise ValueError(f"{name}:{i + 1}: unterminated ``` fence")
        skip_reason = None
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = SKIP_MARKER.match(lines[k].strip()) if k >= 0 else None
        if marker:
            skip_reason = marker["reason"].strip()
            if not ALLOWED_SKIP.search(skip_reason):
                raise ValueError(
                    f"{name}:{k + 1}: a block may be skipped only when it needs a GPU or "
                    f"network access, got reason {skip_reason!r}"
                )
        body = [line.removeprefix(indent) for line in lines[start:j]]
        blocks.append(Block(language, start + 1, "\n".join(body) + "\n", skip_reason))
        i = j + 1
    return blocks


def python_blocks(path: Path) -> list[Block]:
    name = str(path.relative_to(ROOT))
    return [b for b in extract_blocks(path.read_text(), name) if b.language == "python"]


_RUNNER = textwrap.dedent(
    """
    import json, sys
    path, blocks = sys.argv[1], json.load(open(sys.argv[2]))
    namespace = {"__name__": "__main__"}
    for line, code in blocks:
        # Pad so that tracebacks give the Markdown file's own line numbers.
        exec(compile("\\n" * (line - 1) + code, path, "exec"), namespace)
        print(f"ok {path}:{line}", flush=True)
    """
)


def run_blocks(path: Path, blocks: list[Block], tmp_path: Path) -> subprocess.CompletedProcess:
    """Runs the non-skipped `blocks` of `path` in order in one fresh process."""
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps([(b.line, b.code) for b in blocks if b.skip_reason is None]))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["MPLBACKEND"] = "Agg"
    return subprocess.run(
        [sys.executable, "-c", _RUNNER, str(path), str(spec)],
        check=False,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def _has_python(path: Path) -> bool:
    return "```python" in path.read_text()


@pytest.mark.parametrize(
    "path", [p for p in DOC_FILES if _has_python(p)], ids=lambda p: str(p.relative_to(ROOT))
)
def test_doc_code_blocks_run(path, tmp_path):
    blocks = python_blocks(path)
    name = str(path.relative_to(ROOT))
    assert len(blocks) >= MIN_BLOCKS.get(name, 0), (
        f"{name} has {len(blocks)} python blocks, expected at least {MIN_BLOCKS[name]}"
    )
    runnable = [b for b in blocks if b.skip_reason is None]
    result = run_blocks(path, blocks, tmp_path)
    assert result.returncode == 0, (
        f"{name}: a python block failed (exit {result.returncode})\n"
        f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-8000:]}"
    )
    done = [line for line in result.stdout.splitlines() if line.startswith(f"ok {path}:")]
    assert len(done) == len(runnable), result.stdout


def test_migration_guides_exist():
    for name in MIN_BLOCKS:
        assert (ROOT / name).is_file(), f"{name} is missing"


def test_readme_opens_with_the_two_commands():
    blocks = extract_blocks((ROOT / "README.md").read_text(), "README.md")
    assert blocks, "README.md has no code block"
    assert blocks[0].language == "bash"
    assert blocks[0].code == README_COMMANDS
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash configure.sh\n.venv/bin/python -m pytest -q tests" in ci


def test_readme_links_resolve():
    """Relative links of README.md and docs/*.md point at files that exist."""
    missing = []
    for path in DOC_FILES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
                continue
            if not (path.parent / target).exists():
                missing.append(f"{path.relative_to(ROOT)} -> {target}")
    assert not missing, "broken relative links:\n" + "\n".join(missing)


# The extractor itself, on small texts.


def test_extract_blocks_languages_lines_and_indent():
    text = (
        "intro\n```python\nx = 1\n```\n\n- item\n\n  ```python\n  y = 2\n  ```\n"
        "```text\nsig(a, b)\n```\n"
    )
    blocks = extract_blocks(text)
    assert [(b.language, b.line, b.code) for b in blocks] == [
        ("python", 3, "x = 1\n"),
        ("python", 9, "y = 2\n"),
        ("text", 12, "sig(a, b)\n"),
    ]
    assert all(b.skip_reason is None for b in blocks)


def test_extract_blocks_skip_marker_needs_a_gpu_or_network_reason():
    ok = "<!-- docs-test: skip (needs a GPU) -->\n```python\nrun_on_gpu()\n```\n"
    assert extract_blocks(ok)[0].skip_reason == "needs a GPU"
    net = "<!-- docs-test: skip (downloads from the network) -->\n\n```python\nx\n```\n"
    assert extract_blocks(net)[0].skip_reason == "downloads from the network"
    bad = "<!-- docs-test: skip (too slow) -->\n```python\nx\n```\n"
    with pytest.raises(ValueError, match=r"<doc>:1: .*GPU or network.*'too slow'"):
        extract_blocks(bad)


def test_extract_blocks_unterminated_fence():
    with pytest.raises(ValueError, match=r"<doc>:2: unterminated"):
        extract_blocks("text\n```python\nx = 1\n")


def test_runner_reports_the_markdown_line_of_a_failure(tmp_path):
    doc = tmp_path / "broken.md"
    doc.write_text("# t\n\n```python\nx = 41\n```\n\nprose\n\n```python\nassert x + 1 == 43\n```\n")
    blocks = extract_blocks(doc.read_text(), "broken.md")
    result = run_blocks(doc, blocks, tmp_path)
    assert result.returncode != 0
    assert f"ok {doc}:4" in result.stdout
    assert f'File "{doc}", line 10' in result.stderr
    assert "AssertionError" in result.stderr
