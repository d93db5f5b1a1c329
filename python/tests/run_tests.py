"""Runs test modules as Meson runs a test: exit 0 when they pass, 1 when one
fails, 77 (Meson's "skipped") when every test skipped.

    python3 run_tests.py test_store [test_search ...]

Plain `python3 -m unittest` works too (from this directory, or with
`discover -s python/tests` from the repository root); this wrapper only adds
the skip status.
"""
import sys
import unittest


def main(argv):
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    suite = unittest.defaultTestLoader.loadTestsFromNames(argv[1:])
    result = unittest.TextTestRunner(verbosity=2, stream=sys.stdout).run(suite)
    if not result.wasSuccessful():
        return 1
    if result.testsRun and len(result.skipped) == result.testsRun:
        return 77
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
