"""Runs test modules as Meson runs a test: exit 0 when they pass, 1 when one
fails, 77 (Meson's "skipped") when every test skipped.

    python3 run_tests.py test_store [test_search ...]

Plain `python3 -m unittest` works too (from this directory, or with
`discover -s python/tests` from the repository root); this wrapper only adds
the skip status.
"""
import sys
import unittest


class _Result(unittest.TextTestResult):
    """Counts passed tests: testsRun alone cannot tell "all skipped" (Python 3.12
    leaves tests of a skipped class out of testsRun)."""

    passed = 0

    def addSuccess(self, test):
        super().addSuccess(test)
        self.passed += 1


def main(argv):
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    suite = unittest.defaultTestLoader.loadTestsFromNames(argv[1:])
    runner = unittest.TextTestRunner(verbosity=2, stream=sys.stdout, resultclass=_Result)
    result = runner.run(suite)
    if not result.wasSuccessful():
        return 1
    if result.passed == 0:
        if result.skipped:
            return 77
        print("no test ran", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
