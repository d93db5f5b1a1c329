#!/usr/bin/env python3
"""Checks that lib/'s parts depend only downward (lib/layers.txt).

Usage: check_layers.py SOURCE_ROOT          check the tree
       check_layers.py --self-test SOURCE_ROOT
                     check copies of the tree with an upward include, an
                     upward and a sideways internal call, and a public
                     call (an entry point, in lib/api/) put in: each must
                     be reported (file, line, edge), the clean copy not

Each file of lib/<part>/ (and of the folders lib/layers.txt's `dir` lines
give a part, e.g. cuda/) belongs to that part. An edge from part A to part B
is either
  - an #include "B/..." in a file of A, or
  - a mention, in a file of A, of a kvi__/KVI__ name that B owns: a function
    whose non-static definition is in B (or, defined nowhere, whose
    prototype is in B's header), or a type, struct tag, macro or enum
    constant that a header of B defines, or
  - a call, in a file of A, of a public function (KVI_API) that B defines.
Comments and string literals are ignored. A name a file defines itself
(a local macro, a static function) is its own. A struct tag defined only
inside a .c file is opaque: naming it elsewhere (a pointer to a part's
private state, the store's hooks) is not an edge.
Every edge must point to a part of a lower layer. A function must also be
declared in a header of its own part. The part an `entry` line names is the
only one that defines public (KVI_API) functions, and a name an `only` line
lists may be used by the part that defines it and the part the line names,
by no other. Each violation is printed as
  file:line: A -> B: name (defined in file): why
and the exit status is 1; 0 when there is none.
"""
import os
import re
import sys

SRC_EXT = ('.c', '.h', '.cu', '.cuh')
NAME = r'(?:kvi__|KVI__)\w+'


def strip(text):
    """Comments and string contents blanked, line breaks kept."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith('/*', i):
            j = text.find('*/', i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r'[^\n]', ' ', text[i:j]))
            i = j
        elif text.startswith('//', i):
            j = text.find('\n', i)
            j = n if j < 0 else j
            out.append(' ' * (j - i))
            i = j
        elif c in '"\'':
            j = i + 1
            while j < n and text[j] != c and text[j] != '\n':
                j += 2 if text[j] == '\\' else 1
            j = min(j + 1, n)
            out.append(c + ' ' * max(0, j - i - 2) + (c if j - i >= 2 else ''))
            i = j
        else:
            out.append(c)
            i += 1
    return ''.join(out)


def read_layers(path):
    level, dirs, order, rules = {}, {}, [], {'entry': None, 'only': {}}
    with open(path) as f:
        for ln, line in enumerate(f, 1):
            words = line.split('#', 1)[0].split()
            if not words:
                continue
            if words[0] == 'dir':
                if len(words) != 3:
                    sys.exit('%s:%d: expected "dir FOLDER PART"' % (path, ln))
                dirs[words[1].rstrip('/')] = words[2]
                continue
            if words[0] == 'entry':
                if len(words) != 2:
                    sys.exit('%s:%d: expected "entry PART"' % (path, ln))
                rules['entry'] = words[1]
                continue
            if words[0] == 'only':
                if len(words) < 3:
                    sys.exit('%s:%d: expected "only PART NAME..."' % (path, ln))
                for w in words[2:]:
                    rules['only'][w] = words[1]
                continue
            for w in words:
                if w in level:
                    sys.exit('%s:%d: part %s twice' % (path, ln, w))
                level[w] = len(order)
            order.append(words)
    for d, p in dirs.items():
        if p not in level:
            sys.exit('%s: dir %s names no part %s' % (path, d, p))
    for p in [rules['entry']] + list(rules['only'].values()):
        if p is not None and p not in level:
            sys.exit('%s: entry/only names no part %s' % (path, p))
    for p in level:
        dirs.setdefault('lib/' + p, p)
    return level, dirs, rules


def line_of(text, pos):
    return text.count('\n', 0, pos) + 1


def check(root):
    level, dirs, rules = read_layers(os.path.join(root, 'lib', 'layers.txt'))
    errors = []

    files = {}  # relative path -> part
    for top in sorted({d.split('/')[0] for d in dirs} | {'lib'}):
        for dp, dn, fn in os.walk(os.path.join(root, top)):
            dn.sort()
            for f in sorted(fn):
                if not f.endswith(SRC_EXT):
                    continue
                rel = os.path.relpath(os.path.join(dp, f), root).replace(os.sep, '/')
                part = None
                for d, p in dirs.items():
                    if rel.startswith(d + '/'):
                        part = p
                if part is None:
                    errors.append('%s:1: belongs to no part (lib/layers.txt)' % rel)
                    continue
                files[rel] = part
    text = {}
    for rel in files:
        with open(os.path.join(root, rel), encoding='utf-8') as f:
            text[rel] = strip(f.read())

    func_def, func_decl, header_def, opaque_local, local, api_def = {}, {}, {}, set(), {}, {}
    defn = re.compile(r'^(?!static\b)(?:[\w"]+[ \t*]+)+\**(' + NAME + r')\s*\([^;{}]*\)\s*\{', re.M)
    for rel, s in text.items():
        is_h = rel.endswith(('.h', '.cuh'))
        own = local.setdefault(rel, set())
        for m in re.finditer(r'^\s*#\s*define\s+(' + NAME + ')', s, re.M):
            (header_def if is_h else {}).setdefault(m.group(1), rel)
            own.add(m.group(1))
        for m in re.finditer(r'(?:struct|enum|union)\s+(' + NAME + r')\s*\{', s):
            if is_h:
                header_def.setdefault(m.group(1), rel)
            else:
                opaque_local.add(m.group(1))
            own.add(m.group(1))
        for m in re.finditer(r'\}\s*(' + NAME + r')\s*;', s):
            (header_def if is_h else {}).setdefault(m.group(1), rel)
            own.add(m.group(1))
        for m in re.finditer(r'\btypedef\s[^;{}]*?\b(' + NAME + r')\s*;', s):
            (header_def if is_h else {}).setdefault(m.group(1), rel)
            own.add(m.group(1))
        for m in re.finditer(r'\benum\b[^{;]*\{([^}]*)\}', s):
            for e in re.finditer(r'(?:^|,)\s*(' + NAME + r')\b', m.group(1)):
                (header_def if is_h else {}).setdefault(e.group(1), rel)
                own.add(e.group(1))
        for m in re.finditer(r'^static\b[^;{}=]*?\b(' + NAME + r')\s*\([^;{}]*\)\s*\{', s, re.M):
            if is_h:
                header_def.setdefault(m.group(1), rel)
            own.add(m.group(1))
        for m in defn.finditer(s):
            if is_h:
                header_def.setdefault(m.group(1), rel)
            else:
                func_def.setdefault(m.group(1), (rel, line_of(s, m.start(1))))
            own.add(m.group(1))
        for m in re.finditer(r'^KVI_API\b[^;{}]*?\b(kvi_[a-z]\w*)\s*\(', s, re.M):
            api_def.setdefault(m.group(1), rel)
            own.add(m.group(1))
            if rules['entry'] and files[rel] != rules['entry'] and not is_h:
                errors.append('%s:%d: %s is public (KVI_API) in part %s: only part %s defines public functions '
                              '(lib/layers.txt)' % (rel, line_of(s, m.start(1)), m.group(1), files[rel], rules['entry']))
        if is_h:  # prototypes: a declaration starting in column 0
            for m in re.finditer(r'^(?!static\b|typedef\b|return\b)(?:[\w"]+[ \t*]+)+\**(' + NAME + r')\s*\([^;{}]*\)[^;{}]*;', s, re.M):
                func_decl.setdefault(m.group(1), []).append((rel, line_of(s, m.start(1))))

    def owner(name):
        if name in func_def:
            return func_def[name][0]
        if name in header_def:
            return header_def[name]
        if name in func_decl:
            return func_decl[name][0][0]
        return None

    # A function is declared in a header of the part that defines it.
    for name, (rel, ln) in sorted(func_def.items()):
        for h, hl in func_decl.get(name, []):
            if files[h] != files[rel] and name not in header_def:
                errors.append('%s:%d: %s declares %s, defined in %s (%s): a function is declared in '
                              'its own part\'s header' % (h, hl, files[h], name, rel, files[rel]))

    def edge(rel, ln, to, what, why):
        frm = files[rel]
        if to == frm:
            return
        if level[to] < level[frm]:
            return
        rel_kind = 'above' if level[to] > level[frm] else 'beside'
        errors.append('%s:%d: %s -> %s: %s: %s is %s %s (lib/layers.txt)' % (rel, ln, frm, to, what, to, rel_kind, frm))

    parts = set(level)
    for rel, s in sorted(text.items()):
        here = os.path.dirname(rel)
        for m in re.finditer(r'^\s*#\s*include\s*"([^"]*)"', open(os.path.join(root, rel), encoding='utf-8').read(), re.M):
            inc = m.group(1)
            ln = line_of(open(os.path.join(root, rel), encoding='utf-8').read(), m.start())
            first = inc.split('/')[0]
            if inc.startswith('kvinject/') or inc in ('kvinject.h', 'kvi_build_config.h'):
                continue
            if '/' in inc and first in parts:
                edge(rel, ln, first, '#include "%s"' % inc, 'include')
            elif os.path.exists(os.path.join(root, here, inc)):
                continue
            else:
                errors.append('%s:%d: #include "%s" names no part\'s header (write "PART/header.h")' % (rel, ln, inc))
        seen = set()
        for m in re.finditer(r'\b(' + NAME + r')\b', s):
            name = m.group(1)
            if name in local[rel] or name in opaque_local and name not in header_def:
                continue
            o = owner(name)
            if o is None or o == rel:
                continue
            only = rules['only'].get(name)
            if only and files[rel] not in (only, files[o]) and (name, 'only') not in seen:
                seen.add((name, 'only'))
                errors.append('%s:%d: %s is used in part %s: only part %s (and %s, which defines it) may use it '
                              '(lib/layers.txt)' % (rel, line_of(s, m.start(1)), name, files[rel], only, files[o]))
            key = (name, files[o])
            if key in seen:
                continue
            seen.add(key)
            edge(rel, line_of(s, m.start(1)), files[o], '%s (%s)' % (name, o), 'name')
        for m in re.finditer(r'\b(kvi_[a-z]\w*)\s*\(', s):
            name = m.group(1)
            o = api_def.get(name)
            if o is None or name in local[rel] or (name, files[o]) in seen:
                continue
            seen.add((name, files[o]))
            edge(rel, line_of(s, m.start(1)), files[o], '%s() (%s)' % (name, o), 'call')

    return errors, len(files), len(level)


def self_test(root):
    import shutil
    import tempfile
    # (file, text appended, what the report must say)
    cases = [
        ('lib/base/error.c', '#include "store/store.h"\n',
         'lib/base/error.c:%d: base -> store: #include "store/store.h": store is above base'),
        ('lib/store/store.c', 'void kvi__layers_probe(kvi_store *s) { kvi__search_local(s, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0); }\n',
         'lib/store/store.c:%d: store -> search: kvi__search_local (lib/search/search.c): search is above store'),
        ('lib/xfer/recompute.c', 'void kvi__layers_probe(void) { kvi__comm_destroy(0, 0); }\n',
         'lib/xfer/recompute.c:%d: xfer -> tp: kvi__comm_destroy (lib/tp/comm.c): tp is beside xfer'),
        ('lib/xfer/recompute.c', 'void kvi__layers_probe(void) { kvi_comm_destroy(0); }\n',
         'lib/xfer/recompute.c:%d: xfer -> api: kvi_comm_destroy() (lib/api/tp.c): api is above xfer'),
        ('lib/store/store.c', 'KVI_API int kvi_layers_probe(void) { return 0; }\n',
         'lib/store/store.c:%d: kvi_layers_probe is public (KVI_API) in part store: only part api defines public'),
        ('lib/search/search.c', 'void kvi__layers_probe(kvi__devguard *g) { kvi__cuda_enter(0, g, 0); }\n',
         'lib/search/search.c:%d: kvi__cuda_enter is used in part search: only part api'),
    ]
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i, case in enumerate([None] + cases):
            copy = os.path.join(tmp, str(i))
            for d in ('lib', 'cuda'):
                shutil.copytree(os.path.join(root, d), os.path.join(copy, d))
            want = None
            if case:
                path, add, msg = case
                with open(os.path.join(copy, path), encoding='utf-8') as f:
                    n = f.read().count('\n')
                with open(os.path.join(copy, path), 'a', encoding='utf-8') as f:
                    f.write(add)
                want = msg % (n + 1)
            errors = check(copy)[0]
            ok = not errors if want is None else any(e.startswith(want) for e in errors) and len(errors) == 1
            print('%s: %s' % ('ok' if ok else 'FAILED', want or 'the tree as it is: no violation'))
            if not ok:
                failed += 1
                for e in errors:
                    print('  got: ' + e)
    return 1 if failed else 0


def main():
    args = sys.argv[1:]
    if args and args[0] == '--self-test':
        return self_test(args[1] if len(args) > 1 else '.')
    errors, nfiles, nparts = check(args[0] if args else '.')
    for e in errors:
        print(e)
    if errors:
        print('%d layering violation(s)' % len(errors))
        return 1
    print('lib/ layers: %d files, %d parts, no upward or sideways use' % (nfiles, nparts))
    return 0


if __name__ == '__main__':
    sys.exit(main())
