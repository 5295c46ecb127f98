#!/usr/bin/env python3
"""tools/mutants.py's own logic, and its catalogue against the code as it is now: the catalogue
parses, every mutant's text occurs exactly once in its file (a mutant whose code moved on fails
here, not months later in a run that reports it "broken"), a planted file goes back when the
block around it fails, and the runner reads which suites failed from ctest's summary. Running
the mutants themselves takes an hour: tools/mutants.py, by hand."""
import importlib.util
import os
import tempfile
import unittest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("mutants", os.path.join(REPO, "tools", "mutants.py"))
mutants = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mutants)

ONE = """# a comment
== first-one
file: a/b.cpp
tests: ^test_x$
why: a bug
find:
  int x = 1;
  int y = 2;
replace:
  int x = 2;

== second
file: c.h
tests: ^test_y$
why: another
find:
return a;
replace:
return b;
"""


class Catalogue(unittest.TestCase):
    def test_blocks_keep_their_lines_and_indentation(self):
        ms = mutants.parse_catalogue(ONE)
        self.assertEqual([m["name"] for m in ms], ["first-one", "second"])
        self.assertEqual(ms[0]["find"], "  int x = 1;\n  int y = 2;")
        self.assertEqual(ms[0]["replace"], "  int x = 2;")  # the blank line before '==' dropped
        self.assertEqual(ms[1]["tests"], "^test_y$")

    def test_bad_catalogues_name_the_line(self):
        cases = [(ONE.replace("why: another\n", ""), "has no 'why:'"),
                 (ONE.replace("== second", "== first-one"), "named twice"),
                 (ONE.replace("return b;", "return a;"), "changes nothing"),
                 (ONE.replace("== second", "== Second one"), "lowercase"),
                 ("stray text\n" + ONE, "catalogue:1: expected"),
                 (ONE.replace("tests: ^test_y$", "tests: ^test_y$\ntests: ^z$"), "twice")]
        for text, message in cases:
            with self.assertRaises(ValueError) as e:
                mutants.parse_catalogue(text)
            self.assertIn(message, str(e.exception))

    def test_the_catalogue_fits_the_code_as_it_is(self):
        with open(os.path.join(REPO, "tools", "mutants.txt")) as f:
            ms = mutants.parse_catalogue(f.read())
        self.assertGreaterEqual(len(ms), 20)
        for m in ms:
            with open(os.path.join(REPO, m["file"])) as f:
                source = f.read()
            self.assertEqual(source.count(m["find"]), 1,
                             f"mutant {m['name']}: its text is not in {m['file']} exactly once")


class Planting(unittest.TestCase):
    def test_a_mutant_needs_its_text_exactly_once(self):
        m = {"find": "a;", "replace": "b;"}
        self.assertEqual(mutants.mutated("x = a;\n", m), "x = b;\n")
        self.assertIsNone(mutants.mutated("x = a; y = a;\n", m))
        self.assertIsNone(mutants.mutated("x = c;\n", m))

    def test_the_file_goes_back_when_the_block_fails(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "f.cpp")
            with open(path, "w") as f:
                f.write("original\n")
            before = os.stat(path).st_mtime
            with self.assertRaises(KeyboardInterrupt):
                with mutants.Planted(path, "mutant\n"):
                    with open(path) as f:
                        self.assertEqual(f.read(), "mutant\n")
                    raise KeyboardInterrupt
            with open(path) as f:
                self.assertEqual(f.read(), "original\n")
            self.assertGreater(os.stat(path).st_mtime, before)  # so the next build recompiles


class CtestOutput(unittest.TestCase):
    def test_failed_suites_come_from_the_summary(self):
        out = """The following tests FAILED:
\t 12 - test_ddp (Failed)                               unit
\t 30 - test_sampler (Timeout)
\t 31 - test_resume (SEGFAULT)
Errors while running CTest"""
        self.assertEqual(mutants.failed_suites(out), ["test_ddp", "test_sampler", "test_resume"])


if __name__ == "__main__":
    unittest.main()
