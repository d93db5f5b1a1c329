#!/usr/bin/env python3
"""Checks that no function of lib/ or cuda/ is longer than a limit (default
120 lines, from the line its declaration starts on to its closing brace),
other than those tests/layers/long_functions.txt names (straight-line
validators, one "file:function" per line, each with its reason), and that
no file of lib/ or cuda/ is longer than a file limit (default 800 lines),
other than those tests/layers/long_files.txt names (one path per line,
followed by its reason: a file on its way to being split).

Usage: check_functions.py SOURCE_ROOT [--limit N] [--file-limit N]
       check_functions.py --self-test SOURCE_ROOT

Comments and string literals are blanked first; a function is a top-level
brace block (inside namespace or extern "C" blocks) whose head (the lines before its "{" back to the previous ";",
"}" or blank line) has a "(" and is not a struct, enum, union, typedef or
initializer. Each long function is printed as
  file:line: name: N lines (limit L)
A file's length is its number of lines, comments included (wc -l). cuda/
is held to the same file limit as lib/: its files are written by hand like
lib/'s (the per-dtype-pair compilations of transfer_kernels.cu come from the
one file through cuda/meson.build, nothing is generated into the tree), so
a kernel family past the limit splits the way lib/'s parts do, into files
over the shared headers (vec.cuh, rope.cuh). Each long file is printed as
  file: N lines (file limit L)
and so is each entry of long_files.txt whose file is missing, within the
limit or given without a reason (an entry outlives its file's split, and
the list would hide the next long file). The exit status is 1 when any of
these is printed; 0 when there is none. --self-test checks a planted
121-line function is reported and a 120-line one is not, and that in a
planted tree an 801-line file of lib/ and one of cuda/ are reported, an
800-line one is not, nor a listed one, and a stale entry is.
"""
import os
import re
import sys

EXT = ('.c', '.h', '.cu', '.cuh')


def blank(text):
    text = re.sub(r'/\*.*?\*/', lambda m: re.sub(r'[^\n]', ' ', m.group(0)), text, flags=re.S)
    text = re.sub(r'//[^\n]*', '', text)
    text = re.sub(r'"(\\.|[^"\\\n])*"', '""', text)
    return re.sub(r"'(\\.|[^'\\\n])*'", "''", text)


def functions(text):
    """(name, first line, lines) of every top-level function of a source
    (namespace and extern "C" blocks are looked through)."""
    lines = blank(text).split('\n')
    out, depth, start, wraps = [], 0, None, []
    for i, line in enumerate(lines):
        for j, ch in enumerate(line):
            if ch == '{':
                if depth == 0 and re.search(r'(\bnamespace\b[\w\s]*|\bextern\s*""\s*)$', line[:j]):
                    wraps.append(True)  # a wrapper, not a block
                    continue
                if depth == 0:
                    start = i
                depth += 1
            elif ch == '}':
                if depth == 0:
                    if wraps:
                        wraps.pop()
                    continue
                depth -= 1
                if depth == 0 and start is not None:
                    h = start
                    while h > 0 and lines[h - 1].strip() and not lines[h - 1].rstrip().endswith((';', '}', '{')):
                        h -= 1
                    head = ' '.join(x.strip() for x in lines[h:start + 1])
                    pre = head.split('(')[0]
                    if '(' in head and '=' not in pre and not re.match(r'(extern|struct|enum|union|typedef)\b', head):
                        names = [x for x in re.findall(r'(\w+)\s*\(', head) if not x.startswith('__')]
                        out.append((names[0] if names else '?', h + 1, i - h + 1))
                    start = None
    return out


def check(root, limit, allowed):
    bad = []
    for rel in sources(root):
        with open(os.path.join(root, rel), encoding='utf-8') as fh:
            for name, line, n in functions(fh.read()):
                if n > limit and '%s:%s' % (rel, name) not in allowed:
                    bad.append('%s:%d: %s: %d lines (limit %d)' % (rel, line, name, n, limit))
    return bad


def allowlist(root):
    p = os.path.join(root, 'tests', 'layers', 'long_functions.txt')
    if not os.path.exists(p):
        return set()
    with open(p, encoding='utf-8') as fh:
        return {ln.split()[0] for ln in fh if ln.strip() and not ln.startswith('#')}


def sources(root):
    """Relative paths of the sources of lib/ and cuda/, sorted."""
    out = []
    for top in ('lib', 'cuda'):
        for d, _, files in os.walk(os.path.join(root, top)):
            out += [os.path.relpath(os.path.join(d, f), root) for f in files if f.endswith(EXT)]
    return sorted(out)


def file_allowlist(root):
    """{path: reason} of tests/layers/long_files.txt (reason '' when missing)."""
    p = os.path.join(root, 'tests', 'layers', 'long_files.txt')
    if not os.path.exists(p):
        return {}
    with open(p, encoding='utf-8') as fh:
        rows = [ln.split(None, 1) for ln in fh if ln.strip() and not ln.startswith('#')]
    return {r[0]: r[1].strip() if len(r) > 1 else '' for r in rows}


def check_files(root, limit, allowed):
    """Files of lib/ and cuda/ over `limit` lines that `allowed` does not
    name, and the entries of `allowed` that name no such file."""
    bad, long = [], set()
    for rel in sources(root):
        with open(os.path.join(root, rel), encoding='utf-8') as fh:
            n = len(fh.read().splitlines())
        if n > limit:
            long.add(rel)
            if rel not in allowed:
                bad.append('%s: %d lines (file limit %d)' % (rel, n, limit))
    for rel, why in sorted(allowed.items()):
        if rel not in long:
            bad.append('%s: listed in tests/layers/long_files.txt but %s: remove the entry' %
                       (rel, 'within the file limit' if os.path.exists(os.path.join(root, rel)) else 'absent'))
        elif not why:
            bad.append('%s: listed in tests/layers/long_files.txt without a reason' % rel)
    return bad


def self_test_files():
    """An 801-line file of lib/ and of cuda/ reported, an 800-line one and a
    listed 801-line one not, a stale entry and one without a reason reported."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        planted = {'lib/a/long.c': 801, 'lib/a/ok.c': 800, 'lib/a/listed.h': 801, 'lib/a/bare.c': 801,
                   'cuda/long.cu': 801, 'lib/a/notes.txt': 900}
        for rel, n in planted.items():
            os.makedirs(os.path.dirname(os.path.join(tmp, rel)), exist_ok=True)
            with open(os.path.join(tmp, rel), 'w', encoding='utf-8') as fh:
                fh.write('int x;\n' * n)
        os.makedirs(os.path.join(tmp, 'tests', 'layers'))
        with open(os.path.join(tmp, 'tests', 'layers', 'long_files.txt'), 'w', encoding='utf-8') as fh:
            fh.write('# comment\nlib/a/listed.h being split\nlib/a/ok.c being split\nlib/a/gone.c being split\n'
                     'lib/a/bare.c\n')
        got = check_files(tmp, 800, file_allowlist(tmp))
    want = ['cuda/long.cu: 801 lines (file limit 800)',
            'lib/a/long.c: 801 lines (file limit 800)',
            'lib/a/bare.c: listed in tests/layers/long_files.txt without a reason',
            'lib/a/gone.c: listed in tests/layers/long_files.txt but absent: remove the entry',
            'lib/a/ok.c: listed in tests/layers/long_files.txt but within the file limit: remove the entry']
    ok = got == want
    print('self-test (files): %s' % ('PASS' if ok else 'FAIL'))
    for g in got:
        print('  ' + g)
    return ok


def self_test():
    body = lambda n: 'int f%d(int x) {\n' % n + '  x++;\n' * (n - 2) + '}\n'  # noqa: E731
    src = '/* c { */\n' + body(121) + '\nnamespace {\n' + body(120) + '}\nextern "C" {\n' + body(122) + '}\n'
    got = [(name, n) for name, _, n in functions(src)]
    ok = got == [('f121', 121), ('f120', 120), ('f122', 122)]
    print('self-test: %s (%s)' % ('PASS' if ok else 'FAIL', got))
    ok = self_test_files() and ok
    return 0 if ok else 1


def main(argv):
    if argv[:1] == ['--self-test']:
        return self_test()
    root = argv[0]
    limit = int(argv[argv.index('--limit') + 1]) if '--limit' in argv else 120
    file_limit = int(argv[argv.index('--file-limit') + 1]) if '--file-limit' in argv else 800
    bad = check(root, limit, allowlist(root))
    for b in bad:
        print(b)
    print('%d function(s) over %d lines' % (len(bad), limit))
    bad_files = check_files(root, file_limit, file_allowlist(root))
    for b in bad_files:
        print(b)
    print('%d file(s) over %d lines or stale in tests/layers/long_files.txt' % (len(bad_files), file_limit))
    return 1 if bad or bad_files else 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
