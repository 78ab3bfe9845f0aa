"""The docs, docstrings and comments say what holds, not how it came to,
and their code runs as written.

Git keeps the history: no commit hashes and no issue numbers in the
README, the docs or the code, where they go stale and mean nothing to a
user. Each page's Python blocks run, in order, as one script in a fresh
folder; a block that starts `# <name>.py` is that file, run on its own
after them. A block is not run only where the line before it says why
(`<!-- not run: ... -->`), or says that it is an excerpt of a file the
tests run (`<!-- excerpt: examples/... -->`), whose lines it must match.
"""

import os
import pathlib
import re
import subprocess
import sys
import tempfile
import textwrap

import tensorflow as tf
from absl.testing import parameterized

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_READ = ["README.md", "docs", "tfmemsafe", "tests", "benchmarks", "examples"]
# A word of 7 to 40 hex digits with a letter and a digit (an abbreviated
# or full commit hash), or an issue's number.
_HISTORY = re.compile(
    r"(?<![\w/.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w/-])"
    r"|\b[Ii]ssues? #?\d"
)


def _texts():
    for name in _READ:
        path = _ROOT / name
        files = [path] if path.is_file() else sorted(path.rglob("*"))
        for file in files:
            if file.suffix in (".md", ".py") and file.is_file():
                yield file


class HistoryTest(tf.test.TestCase):
    def test_the_pattern_finds_a_hash_and_an_issue_number(self):
        self.assertRegex("measured at " + "4e38" + "72f here", _HISTORY)
        self.assertRegex("see issue " + "#16", _HISTORY)
        self.assertNotRegex("a batch of 1024, 0x7f, float32", _HISTORY)

    def test_no_commit_hash_or_issue_number(self):
        found = []
        for file in _texts():
            for number, line in enumerate(file.read_text().splitlines(), 1):
                if _HISTORY.search(line):
                    where = file.relative_to(_ROOT)
                    found.append(f"{where}:{number}: {line.strip()}")
        self.assertGreater(len(list(_texts())), 50)
        self.assertEqual(found, [], msg="\n".join(found))


_BLOCK = re.compile(
    r"(?:<!-- (not run|excerpt): (.+?) -->\n)?```python\n(.*?)```", re.S
)
_PAGES = [
    "README.md",
    *sorted(f"docs/{p.name}" for p in (_ROOT / "docs").glob("*.md")),
]


def _blocks(page):
    """`(kind, note, code)` of each Python block of a page; `kind` is
    `None` for a block to run."""
    found = _BLOCK.findall((_ROOT / page).read_text())
    return [(kind, note, textwrap.dedent(code)) for kind, note, code in found]


def _stripped(lines):
    return [line.strip() for line in lines if line.strip()]


class SnippetTest(parameterized.TestCase, tf.test.TestCase):
    def test_every_block_is_run_or_says_why_not(self):
        blocks = [b for page in _PAGES for b in _blocks(page)]
        self.assertGreater(len(blocks), 20)
        for kind, note, code in blocks:
            if kind == "not run":
                self.assertGreater(len(note), 10, msg=code)

    def test_excerpts_match_their_files(self):
        for page in _PAGES:
            for kind, note, code in _blocks(page):
                if kind != "excerpt":
                    continue
                lines = _stripped((_ROOT / note).read_text().splitlines())
                wanted = _stripped(code.splitlines())
                starts = [
                    i
                    for i in range(len(lines))
                    if lines[i : i + len(wanted)] == wanted
                ]
                self.assertNotEmpty(starts, msg=f"{page}: not in {note}")

    @parameterized.named_parameters(
        (page.replace("/", "_").replace(".", "_").replace("-", "_"), page)
        for page in _PAGES
        if any(kind == "" for kind, _, _ in _blocks(page))
    )
    def test_the_page_runs_as_written(self, page):
        script, files = [], []
        for kind, _, code in _blocks(page):
            if kind:
                continue
            first = code.splitlines()[0]
            if re.fullmatch(r"# [\w-]+\.py", first):
                files.append((first[2:], code))
            else:
                script.append(code)
        with tempfile.TemporaryDirectory() as folder:
            runs = [("snippets.py", "\n\n".join(script))] if script else []
            for name, code in runs + files:
                pathlib.Path(folder, name).write_text(code)
                done = subprocess.run(
                    [sys.executable, name],
                    cwd=folder,
                    env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
                    capture_output=True,
                    text=True,
                    timeout=900,
                )
                self.assertEqual(
                    done.returncode, 0, msg=f"{page}, {name}:\n{done.stderr}"
                )
