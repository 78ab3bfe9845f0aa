"""The docs, docstrings and comments say what holds, not how it came to.

Git keeps the history: no commit hashes and no issue numbers in the
README, the docs or the code, where they go stale and mean nothing to a
user.
"""

import pathlib
import re

import tensorflow as tf

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
