/*
 * ABI checks on the built libkvinject.so, in the spirit of libinput's
 * symbols-leak-test and libbpf's map check: what the library exports must be
 * exactly what lib/kvinject.map lists, each in the version node the map puts
 * it in, each declared with KVI_API in an installed header.
 *
 * The library is read as a file (its ELF .dynsym, .gnu.version, .gnu.version_d
 * and .dynamic), not through nm or readelf, so the test needs no binutils.
 * 64-bit little-endian ELF only; anything else fails with a message saying so.
 *
 * Arguments (Meson passes them, see meson.build):
 *   --lib=PATH          the built shared library
 *   --map=PATH          the linker version script
 *   --include=DIR       the source include directory (kvinject.h and the headers under kvinject/)
 *   --soname=NAME       expected DT_SONAME
 *   --version=X.Y.Z     the project version Meson was configured with
 *   --features=C,B,N    expected kvi_features(): 0/1 for CUDA, cuBLASLt, NCCL
 *   --init-src=PATH     a header-check source that must use every *_INIT macro
 *                       (may be repeated)
 *
 * SPDX-License-Identifier: Apache-2.0
 */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <ctype.h>
#include <dirent.h>
#include <dlfcn.h>
#include <elf.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kvinject.h>

/* ------------------------------------------------------------------------ */
/* Small helpers                                                            */
/* ------------------------------------------------------------------------ */

typedef struct strlist {
  char **v;
  size_t n, cap;
} strlist;

static void sl_push_n(strlist *l, const char *s, size_t len) {
  if (l->n == l->cap) {
    l->cap = l->cap ? 2 * l->cap : 32;
    l->v = realloc(l->v, l->cap * sizeof *l->v);
    assert_non_null(l->v);
  }
  char *c = malloc(len + 1);
  assert_non_null(c);
  memcpy(c, s, len);
  c[len] = '\0';
  l->v[l->n++] = c;
}

static void sl_push(strlist *l, const char *s) { sl_push_n(l, s, strlen(s)); }

static long sl_find(const strlist *l, const char *s) {
  for (size_t i = 0; i < l->n; i++)
    if (strcmp(l->v[i], s) == 0) return (long)i;
  return -1;
}

static void sl_free(strlist *l) {
  for (size_t i = 0; i < l->n; i++) free(l->v[i]);
  free(l->v);
  memset(l, 0, sizeof *l);
}

/* An error message kept for the tests to report (group setup cannot fail one
 * test without failing all of them, so loading errors are reported by each
 * test that needs the data). */
static char *msgf(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  char *s = NULL;
  if (vasprintf(&s, fmt, ap) < 0) s = NULL;
  va_end(ap);
  return s ? s : strdup("out of memory formatting an error");
}

static char *read_file(const char *path, size_t *out_size, char **err) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    *err = msgf("cannot open %s: %s", path, strerror(errno));
    return NULL;
  }
  char *buf = NULL;
  size_t n = 0, cap = 0;
  for (;;) {
    if (cap - n < 65536) {
      cap = cap ? 2 * cap : 1 << 20;
      char *nb = realloc(buf, cap + 1);
      if (!nb) {
        free(buf);
        fclose(f);
        *err = msgf("out of memory reading %s", path);
        return NULL;
      }
      buf = nb;
    }
    size_t got = fread(buf + n, 1, cap - n, f);
    n += got;
    if (got == 0) break;
  }
  int bad = ferror(f);
  fclose(f);
  if (bad) {
    free(buf);
    *err = msgf("error reading %s", path);
    return NULL;
  }
  buf[n] = '\0';
  *out_size = n;
  return buf;
}

/* ------------------------------------------------------------------------ */
/* Arguments                                                                */
/* ------------------------------------------------------------------------ */

static const char *arg_lib, *arg_map, *arg_include, *arg_soname, *arg_version, *arg_features;
static strlist arg_init_srcs;

/* ------------------------------------------------------------------------ */
/* The version script                                                       */
/* ------------------------------------------------------------------------ */

typedef struct map_info {
  strlist nodes;   /* version node names, in file order */
  strlist globals; /* exported names */
  strlist owner;   /* owner.v[i]: the node of globals.v[i] */
  char *err;
} map_info;

/* Tokens: identifiers/globs, and the punctuation { } ; : */
typedef struct lexer {
  const char *p;
  int line;
  char tok[256];
} lexer;

static int lex_next(lexer *lx) {
  for (;;) {
    while (*lx->p && isspace((unsigned char)*lx->p)) {
      if (*lx->p == '\n') lx->line++;
      lx->p++;
    }
    if (lx->p[0] == '/' && lx->p[1] == '*') {
      const char *e = strstr(lx->p + 2, "*/");
      for (const char *q = lx->p; q < (e ? e : lx->p + strlen(lx->p)); q++)
        if (*q == '\n') lx->line++;
      lx->p = e ? e + 2 : lx->p + strlen(lx->p);
      continue;
    }
    if (*lx->p == '#') {
      while (*lx->p && *lx->p != '\n') lx->p++;
      continue;
    }
    break;
  }
  if (!*lx->p) {
    lx->tok[0] = '\0';
    return 0;
  }
  if (strchr("{};:", *lx->p)) {
    lx->tok[0] = *lx->p++;
    lx->tok[1] = '\0';
    return 1;
  }
  size_t n = 0;
  if (*lx->p == '"') { /* extern "C++" */
    lx->tok[n++] = *lx->p++;
    while (*lx->p && *lx->p != '"' && n < sizeof lx->tok - 2) lx->tok[n++] = *lx->p++;
    if (*lx->p == '"') lx->tok[n++] = *lx->p++;
  } else {
    while (*lx->p && !isspace((unsigned char)*lx->p) && !strchr("{};:", *lx->p) && n < sizeof lx->tok - 1)
      lx->tok[n++] = *lx->p++;
  }
  lx->tok[n] = '\0';
  return 1;
}

static void parse_map(map_info *m, const char *path) {
  size_t size;
  char *text = read_file(path, &size, &m->err);
  if (!text) return;
  lexer lx = {text, 1, {0}};
  while (lex_next(&lx)) {
    char node[256];
    if (strcmp(lx.tok, "{") == 0) {
      m->err = msgf("%s:%d: anonymous version node; libkvinject uses one named node per minor release", path, lx.line);
      goto out;
    }
    snprintf(node, sizeof node, "%s", lx.tok);
    if (sl_find(&m->nodes, node) >= 0) {
      m->err = msgf("%s:%d: version node %s defined twice", path, lx.line, node);
      goto out;
    }
    sl_push(&m->nodes, node);
    if (!lex_next(&lx) || strcmp(lx.tok, "{") != 0) {
      m->err = msgf("%s:%d: expected '{' after %s, got '%s'", path, lx.line, node, lx.tok);
      goto out;
    }
    int scope = 1; /* entries before any label are global */
    for (;;) {
      if (!lex_next(&lx)) {
        m->err = msgf("%s: unterminated node %s", path, node);
        goto out;
      }
      if (strcmp(lx.tok, "}") == 0) break;
      if (strcmp(lx.tok, "extern") == 0) {
        m->err = msgf("%s:%d: extern blocks are not expected in a C library's map", path, lx.line);
        goto out;
      }
      char name[256];
      snprintf(name, sizeof name, "%s", lx.tok);
      if (!lex_next(&lx)) {
        m->err = msgf("%s: unexpected end after %s", path, name);
        goto out;
      }
      if (strcmp(lx.tok, ":") == 0) {
        if (strcmp(name, "global") == 0) scope = 1;
        else if (strcmp(name, "local") == 0) scope = 0;
        else {
          m->err = msgf("%s:%d: unknown label %s:", path, lx.line, name);
          goto out;
        }
        continue;
      }
      if (strcmp(lx.tok, ";") != 0) {
        m->err = msgf("%s:%d: expected ';' after %s, got '%s'", path, lx.line, name, lx.tok);
        goto out;
      }
      if (!scope) continue;
      if (strpbrk(name, "*?[")) {
        m->err = msgf("%s:%d: pattern %s in a global: section; list each symbol by name", path, lx.line, name);
        goto out;
      }
      if (sl_find(&m->globals, name) >= 0) {
        m->err = msgf("%s:%d: %s listed twice", path, lx.line, name);
        goto out;
      }
      sl_push(&m->globals, name);
      sl_push(&m->owner, node);
    }
    /* } [parent] ; */
    if (!lex_next(&lx)) {
      m->err = msgf("%s: missing ';' after node %s", path, node);
      goto out;
    }
    if (strcmp(lx.tok, ";") != 0) {
      if (sl_find(&m->nodes, lx.tok) < 0) {
        m->err = msgf("%s:%d: node %s inherits from %s, which is not defined before it", path, lx.line, node, lx.tok);
        goto out;
      }
      if (!lex_next(&lx) || strcmp(lx.tok, ";") != 0) {
        m->err = msgf("%s:%d: expected ';' after node %s", path, lx.line, node);
        goto out;
      }
    }
  }
  if (m->globals.n == 0) m->err = msgf("%s: no global symbols", path);
out:
  free(text);
}

/* ------------------------------------------------------------------------ */
/* The ELF file                                                             */
/* ------------------------------------------------------------------------ */

typedef struct elf_info {
  strlist exported;     /* defined global/weak symbols, version nodes excluded */
  strlist exported_ver; /* the version node of each (or "" if unversioned) */
  strlist exported_kind;/* "FUNC", "OBJECT", ... */
  strlist node_syms;    /* SHN_ABS symbols naming version definitions */
  strlist verdefs;      /* version definitions, base (soname) excluded */
  strlist needed;       /* DT_NEEDED */
  char *soname;         /* DT_SONAME or NULL */
  int textrel;
  char *err;
} elf_info;

static int in_bounds(size_t size, uint64_t off, uint64_t len) { return off <= size && len <= size - off; }

static const char *str_at(const char *file, const Elf64_Shdr *strtab, size_t size, uint64_t off) {
  if (!in_bounds(size, strtab->sh_offset, strtab->sh_size) || off >= strtab->sh_size) return NULL;
  const char *s = file + strtab->sh_offset + off;
  return memchr(s, '\0', strtab->sh_size - off) ? s : NULL;
}

static const char *sym_kind(unsigned type) {
  switch (type) {
  case STT_NOTYPE: return "NOTYPE";
  case STT_OBJECT: return "OBJECT";
  case STT_FUNC: return "FUNC";
  case STT_COMMON: return "COMMON";
  case STT_TLS: return "TLS";
  case STT_GNU_IFUNC: return "IFUNC";
  default: return "OTHER";
  }
}

static void parse_elf(elf_info *e, const char *path) {
  size_t size;
  char *file = read_file(path, &size, &e->err);
  if (!file) return;
  const uint16_t one = 1;
  const Elf64_Ehdr *eh = (const Elf64_Ehdr *)file;
  const Elf64_Shdr *sh, *dynsym = NULL, *dynamic = NULL, *versym = NULL, *verdef = NULL;
  const char **vernames = NULL;
  size_t nvernames = 0;

  if (*(const unsigned char *)&one != 1) {
    e->err = msgf("this test reads ELF fields natively and needs a little-endian host");
    goto out;
  }
  if (size < sizeof *eh || memcmp(eh->e_ident, ELFMAG, SELFMAG) != 0) {
    e->err = msgf("%s is not an ELF file", path);
    goto out;
  }
  if (eh->e_ident[EI_CLASS] != ELFCLASS64 || eh->e_ident[EI_DATA] != ELFDATA2LSB) {
    e->err = msgf("%s is not a 64-bit little-endian ELF file (class %d, data %d); this test handles only that",
                  path, eh->e_ident[EI_CLASS], eh->e_ident[EI_DATA]);
    goto out;
  }
  if (eh->e_type != ET_DYN) {
    e->err = msgf("%s is not a shared object (e_type %d)", path, eh->e_type);
    goto out;
  }
  if (eh->e_shnum == 0 || eh->e_shentsize != sizeof(Elf64_Shdr) ||
      !in_bounds(size, eh->e_shoff, (uint64_t)eh->e_shnum * sizeof(Elf64_Shdr))) {
    e->err = msgf("%s: no usable section header table (e_shnum %d, e_shentsize %d)", path, eh->e_shnum,
                  eh->e_shentsize);
    goto out;
  }
  sh = (const Elf64_Shdr *)(file + eh->e_shoff);
  for (unsigned i = 0; i < eh->e_shnum; i++) {
    const Elf64_Shdr *s = &sh[i];
    if (s->sh_type != SHT_NOBITS && !in_bounds(size, s->sh_offset, s->sh_size)) {
      e->err = msgf("%s: section %u lies outside the file", path, i);
      goto out;
    }
    if (s->sh_link >= eh->e_shnum &&
        (s->sh_type == SHT_DYNSYM || s->sh_type == SHT_DYNAMIC || s->sh_type == SHT_GNU_verdef)) {
      e->err = msgf("%s: section %u links to a section that does not exist", path, i);
      goto out;
    }
    switch (s->sh_type) {
    case SHT_DYNSYM:
      if (dynsym) {
        e->err = msgf("%s: two SHT_DYNSYM sections", path);
        goto out;
      }
      dynsym = s;
      break;
    case SHT_DYNAMIC: dynamic = s; break;
    case SHT_GNU_versym: versym = s; break;
    case SHT_GNU_verdef: verdef = s; break;
    default: break;
    }
  }
  if (!dynsym) {
    e->err = msgf("%s: no SHT_DYNSYM section", path);
    goto out;
  }
  if (dynsym->sh_entsize != sizeof(Elf64_Sym) || sh[dynsym->sh_link].sh_type != SHT_STRTAB) {
    e->err = msgf("%s: malformed .dynsym (entsize %llu)", path, (unsigned long long)dynsym->sh_entsize);
    goto out;
  }

  /* Version definitions: index -> name. */
  if (verdef) {
    const Elf64_Shdr *vstr = &sh[verdef->sh_link];
    uint64_t off = 0;
    for (uint64_t k = 0; k < verdef->sh_info; k++) {
      if (!in_bounds(verdef->sh_size, off, sizeof(Elf64_Verdef))) break;
      const Elf64_Verdef *vd = (const Elf64_Verdef *)(file + verdef->sh_offset + off);
      if (!in_bounds(verdef->sh_size, off + vd->vd_aux, sizeof(Elf64_Verdaux))) break;
      const Elf64_Verdaux *va = (const Elf64_Verdaux *)(file + verdef->sh_offset + off + vd->vd_aux);
      const char *name = str_at(file, vstr, size, va->vda_name);
      if (!name) {
        e->err = msgf("%s: a version definition has a bad name", path);
        goto out;
      }
      if (vd->vd_ndx >= nvernames) {
        size_t nn = (size_t)vd->vd_ndx + 1;
        const char **nv = realloc(vernames, nn * sizeof *nv);
        assert_non_null(nv);
        for (size_t j = nvernames; j < nn; j++) nv[j] = NULL;
        vernames = nv;
        nvernames = nn;
      }
      vernames[vd->vd_ndx] = name;
      if (!(vd->vd_flags & VER_FLG_BASE)) sl_push(&e->verdefs, name);
      if (vd->vd_next == 0) break;
      off += vd->vd_next;
    }
  }

  const Elf64_Shdr *strtab = &sh[dynsym->sh_link];
  const Elf64_Sym *syms = (const Elf64_Sym *)(file + dynsym->sh_offset);
  const size_t nsyms = dynsym->sh_size / sizeof(Elf64_Sym);
  const Elf64_Half *vs = NULL;
  if (versym && versym->sh_size / sizeof(Elf64_Half) >= nsyms) vs = (const Elf64_Half *)(file + versym->sh_offset);
  for (size_t i = 1; i < nsyms; i++) {
    const Elf64_Sym *s = &syms[i];
    const unsigned bind = ELF64_ST_BIND(s->st_info), type = ELF64_ST_TYPE(s->st_info);
    const unsigned vis = ELF64_ST_VISIBILITY(s->st_other);
    if (s->st_shndx == SHN_UNDEF) continue;
    if (bind != STB_GLOBAL && bind != STB_WEAK && bind != STB_GNU_UNIQUE) continue;
    if (type == STT_SECTION || type == STT_FILE) continue;
    if (vis == STV_HIDDEN || vis == STV_INTERNAL) continue;
    const char *name = str_at(file, strtab, size, s->st_name);
    if (!name) {
      e->err = msgf("%s: dynamic symbol %zu has a bad name", path, i);
      goto out;
    }
    if (s->st_shndx == SHN_ABS && type == STT_OBJECT && sl_find(&e->verdefs, name) >= 0) {
      sl_push(&e->node_syms, name);
      continue;
    }
    const char *ver = "";
    if (vs) {
      const unsigned ndx = vs[i] & 0x7fffu;
      if (ndx >= 2 && ndx < nvernames && vernames[ndx]) ver = vernames[ndx];
    }
    sl_push(&e->exported, name);
    sl_push(&e->exported_ver, ver);
    sl_push(&e->exported_kind, sym_kind(type));
  }

  if (dynamic) {
    const Elf64_Shdr *dstr = &sh[dynamic->sh_link];
    const Elf64_Dyn *d = (const Elf64_Dyn *)(file + dynamic->sh_offset);
    const size_t nd = dynamic->sh_size / sizeof(Elf64_Dyn);
    for (size_t i = 0; i < nd && d[i].d_tag != DT_NULL; i++) {
      const char *s;
      switch (d[i].d_tag) {
      case DT_SONAME:
        if ((s = str_at(file, dstr, size, d[i].d_un.d_val))) e->soname = strdup(s);
        break;
      case DT_NEEDED:
        if ((s = str_at(file, dstr, size, d[i].d_un.d_val))) sl_push(&e->needed, s);
        break;
      case DT_TEXTREL: e->textrel = 1; break;
      case DT_FLAGS:
        if (d[i].d_un.d_val & DF_TEXTREL) e->textrel = 1;
        break;
      default: break;
      }
    }
  }
out:
  free(vernames);
  free(file);
}

/* ------------------------------------------------------------------------ */
/* The public headers                                                       */
/* ------------------------------------------------------------------------ */

typedef struct header_info {
  strlist api_decls;    /* names declared as KVI_API functions */
  strlist plain_decls;  /* "name (file)" of function declarations without KVI_API */
  strlist init_macros;  /* KVI_*_INIT macro names */
  strlist files;
  char *err;
} header_info;

static int is_ident(int c) { return isalnum(c) || c == '_'; }

/* Blank out comments, string/char literals and preprocessor lines, keeping
 * the length (so nothing shifts) and collecting #define KVI_..._INIT names. */
static void strip_c(char *t, strlist *init_macros) {
  int bol = 1;
  for (char *p = t; *p;) {
    if (bol) {
      char *q = p;
      while (*q == ' ' || *q == '\t') q++;
      if (*q == '#') {
        char *d = q + 1;
        while (*d == ' ' || *d == '\t') d++;
        if (strncmp(d, "define", 6) == 0 && isspace((unsigned char)d[6])) {
          d += 6;
          while (*d == ' ' || *d == '\t') d++;
          char *e = d;
          while (is_ident((unsigned char)*e)) e++;
          if (e - d > 9 && strncmp(d, "KVI_", 4) == 0 && strncmp(e - 5, "_INIT", 5) == 0)
            sl_push_n(init_macros, d, (size_t)(e - d));
        }
        /* to the end of the logical line (backslash continuations) */
        char prev = '\0';
        while (*p && !(*p == '\n' && prev != '\\')) {
          if (p[0] == '/' && p[1] == '*') { /* a comment may span lines */
            while (*p && !(p[0] == '*' && p[1] == '/')) *p++ = ' ';
            if (*p) { *p++ = ' '; *p++ = ' '; }
            prev = ' ';
            continue;
          }
          prev = *p;
          *p++ = ' ';
        }
        continue;
      }
    }
    bol = 0;
    if (p[0] == '/' && p[1] == '*') {
      while (*p && !(p[0] == '*' && p[1] == '/')) {
        if (*p != '\n') *p = ' ';
        p++;
      }
      if (*p) { *p++ = ' '; *p++ = ' '; }
    } else if (p[0] == '/' && p[1] == '/') {
      while (*p && *p != '\n') *p++ = ' ';
    } else if (*p == '"' || *p == '\'') {
      const char qc = *p;
      *p++ = ' ';
      while (*p && *p != qc) {
        if (*p == '\\' && p[1]) *p++ = ' ';
        *p++ = ' ';
      }
      if (*p) *p++ = ' ';
    } else {
      if (*p == '\n') bol = 1;
      p++;
    }
  }
}

/* Every identifier followed by '(' at parenthesis depth 0 is a function
 * declaration (the headers have no inline code; macros are stripped). Its
 * declaration starts after the previous ';', '{' or '}'. */
static void scan_header(header_info *h, const char *path) {
  size_t size;
  char *err = NULL;
  char *text = read_file(path, &size, &err);
  if (!text) {
    h->err = err;
    return;
  }
  sl_push(&h->files, path);
  strip_c(text, &h->init_macros);
  int depth = 0;
  const char *decl = text;
  for (const char *p = text; *p;) {
    if (*p == ';' || *p == '{' || *p == '}') {
      decl = ++p;
      continue;
    }
    if (*p == '(') { depth++; p++; continue; }
    if (*p == ')') { depth--; p++; continue; }
    if (!is_ident((unsigned char)*p) || (p > text && is_ident((unsigned char)p[-1]))) {
      p++;
      continue;
    }
    const char *b = p;
    while (is_ident((unsigned char)*p)) p++;
    const char *q = p;
    while (isspace((unsigned char)*q)) q++;
    if (depth != 0 || *q != '(' || isdigit((unsigned char)*b) || strncmp(b, "__", 2) == 0) continue;
    /* first token of the declaration */
    const char *f = decl;
    while (isspace((unsigned char)*f)) f++;
    const char *fe = f;
    while (is_ident((unsigned char)*fe)) fe++;
    const size_t flen = (size_t)(fe - f);
    char name[256];
    snprintf(name, sizeof name, "%.*s", (int)(p - b), b);
    if (flen == 7 && strncmp(f, "typedef", 7) == 0) continue;
    /* KVI_EXPERIMENTAL is KVI_API for declarations fenced by KVI_ENABLE_EXPERIMENTAL */
    if ((flen == 7 && strncmp(f, "KVI_API", 7) == 0) || (flen == 16 && strncmp(f, "KVI_EXPERIMENTAL", 16) == 0)) {
      if (sl_find(&h->api_decls, name) < 0) sl_push(&h->api_decls, name);
    } else {
      char *s = msgf("%s (%s)", name, path);
      sl_push(&h->plain_decls, s);
      free(s);
    }
  }
  free(text);
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static void scan_headers(header_info *h, const char *incdir) {
  char path[4096];
  snprintf(path, sizeof path, "%s/kvinject.h", incdir);
  scan_header(h, path);
  if (h->err) return;
  snprintf(path, sizeof path, "%s/kvinject", incdir);
  DIR *d = opendir(path);
  if (!d) {
    h->err = msgf("cannot open %s: %s", path, strerror(errno));
    return;
  }
  strlist names = {0};
  struct dirent *de;
  while ((de = readdir(d))) {
    const size_t n = strlen(de->d_name);
    if (n > 2 && strcmp(de->d_name + n - 2, ".h") == 0) sl_push(&names, de->d_name);
  }
  closedir(d);
  if (names.n) qsort(names.v, names.n, sizeof *names.v, cmp_str);
  for (size_t i = 0; i < names.n && !h->err; i++) {
    snprintf(path, sizeof path, "%s/kvinject/%s", incdir, names.v[i]);
    scan_header(h, path);
  }
  sl_free(&names);
}

/* ------------------------------------------------------------------------ */
/* Fixture                                                                  */
/* ------------------------------------------------------------------------ */

typedef struct fixture {
  map_info map;
  elf_info elf;
  header_info hdr;
} fixture;

static int group_setup(void **state) {
  fixture *fx = calloc(1, sizeof *fx);
  assert_non_null(fx);
  parse_map(&fx->map, arg_map);
  parse_elf(&fx->elf, arg_lib);
  scan_headers(&fx->hdr, arg_include);
  *state = fx;
  return 0;
}

static int group_teardown(void **state) {
  fixture *fx = *state;
  sl_free(&fx->map.nodes);
  sl_free(&fx->map.globals);
  sl_free(&fx->map.owner);
  free(fx->map.err);
  sl_free(&fx->elf.exported);
  sl_free(&fx->elf.exported_ver);
  sl_free(&fx->elf.exported_kind);
  sl_free(&fx->elf.node_syms);
  sl_free(&fx->elf.verdefs);
  sl_free(&fx->elf.needed);
  free(fx->elf.soname);
  free(fx->elf.err);
  sl_free(&fx->hdr.api_decls);
  sl_free(&fx->hdr.plain_decls);
  sl_free(&fx->hdr.init_macros);
  sl_free(&fx->hdr.files);
  free(fx->hdr.err);
  free(fx);
  return 0;
}

static const map_info *need_map(void **state) {
  const fixture *fx = *state;
  if (fx->map.err) fail_msg("reading the symbol map: %s", fx->map.err);
  return &fx->map;
}

static const elf_info *need_elf(void **state) {
  const fixture *fx = *state;
  if (fx->elf.err) fail_msg("reading the library: %s", fx->elf.err);
  return &fx->elf;
}

static const header_info *need_headers(void **state) {
  const fixture *fx = *state;
  if (fx->hdr.err) fail_msg("reading the public headers: %s", fx->hdr.err);
  return &fx->hdr;
}

/* ------------------------------------------------------------------------ */
/* Tests                                                                    */
/* ------------------------------------------------------------------------ */

/* The library exports exactly the map's global: names. */
static void exports_match_map(void **state) {
  const map_info *m = need_map(state);
  const elf_info *e = need_elf(state);
  int bad = 0;
  for (size_t i = 0; i < e->exported.n; i++)
    if (sl_find(&m->globals, e->exported.v[i]) < 0) {
      print_error("exported but not in %s: %s (%s)\n", arg_map, e->exported.v[i], e->exported_kind.v[i]);
      bad++;
    }
  for (size_t i = 0; i < m->globals.n; i++)
    if (sl_find(&e->exported, m->globals.v[i]) < 0) {
      print_error("in %s but not exported by the library: %s (not defined, or not KVI_API)\n", arg_map,
                  m->globals.v[i]);
      bad++;
    }
  if (bad) fail_msg("%d symbol(s) differ between the library's .dynsym and the map", bad);
  assert_int_equal(e->exported.n, m->globals.n);
}

/* Every exported name is public API: kvi_ but not the internal kvi__. */
static void exports_have_prefix(void **state) {
  const elf_info *e = need_elf(state);
  int bad = 0;
  for (size_t i = 0; i < e->exported.n; i++) {
    const char *n = e->exported.v[i];
    if (strncmp(n, "kvi_", 4) != 0 || strncmp(n, "kvi__", 5) == 0) {
      print_error("exported symbol without the public kvi_ prefix: %s (%s)\n", n, e->exported_kind.v[i]);
      bad++;
    }
  }
  if (bad) fail_msg("%d exported symbol(s) outside the kvi_ namespace", bad);
}

/* Each symbol carries the version node the map puts it in, and the library
 * defines exactly the map's nodes. */
static void symbol_versions_match_map(void **state) {
  const map_info *m = need_map(state);
  const elf_info *e = need_elf(state);
  if (e->verdefs.n == 0) fail_msg("the library defines no symbol versions: is the version script passed to the linker?");
  int bad = 0;
  for (size_t i = 0; i < m->nodes.n; i++)
    if (sl_find(&e->verdefs, m->nodes.v[i]) < 0) {
      print_error("version node %s of the map is not defined by the library\n", m->nodes.v[i]);
      bad++;
    }
  for (size_t i = 0; i < e->verdefs.n; i++)
    if (sl_find(&m->nodes, e->verdefs.v[i]) < 0) {
      print_error("the library defines version %s, which the map does not\n", e->verdefs.v[i]);
      bad++;
    }
  for (size_t i = 0; i < e->exported.n; i++) {
    const long k = sl_find(&m->globals, e->exported.v[i]);
    if (k < 0) continue; /* reported by exports_match_map */
    if (strcmp(e->exported_ver.v[i], m->owner.v[k]) != 0) {
      print_error("%s has version '%s', the map puts it in %s\n", e->exported.v[i], e->exported_ver.v[i],
                  m->owner.v[k]);
      bad++;
    }
  }
  if (bad) fail_msg("%d symbol version mismatch(es)", bad);
}

/* Each map symbol is declared with KVI_API in a public header; each KVI_API
 * declaration is in the map (else users get link errors); the headers
 * declare no function without KVI_API (it would be hidden). */
static void map_matches_headers(void **state) {
  const map_info *m = need_map(state);
  const header_info *h = need_headers(state);
  int bad = 0;
  for (size_t i = 0; i < m->globals.n; i++)
    if (sl_find(&h->api_decls, m->globals.v[i]) < 0) {
      print_error("%s is in the map but no public header declares it with KVI_API\n", m->globals.v[i]);
      bad++;
    }
  for (size_t i = 0; i < h->api_decls.n; i++)
    if (sl_find(&m->globals, h->api_decls.v[i]) < 0) {
      print_error("%s is declared KVI_API but is not in %s: programs using it would not link\n", h->api_decls.v[i],
                  arg_map);
      bad++;
    }
  for (size_t i = 0; i < h->plain_decls.n; i++) {
    print_error("function declared without KVI_API in a public header: %s\n", h->plain_decls.v[i]);
    bad++;
  }
  if (bad) fail_msg("%d mismatch(es) between the map and the public headers (%zu files scanned)", bad, h->files.n);
}

/* The header-check programs (C99 and C++) use every KVI_*_INIT macro. */
static void init_macros_used_by_header_checks(void **state) {
  const header_info *h = need_headers(state);
  if (h->init_macros.n == 0) fail_msg("no KVI_*_INIT macro found in the headers");
  if (arg_init_srcs.n == 0) skip();
  int bad = 0;
  for (size_t f = 0; f < arg_init_srcs.n; f++) {
    size_t size;
    char *err = NULL;
    char *text = read_file(arg_init_srcs.v[f], &size, &err);
    if (!text) fail_msg("%s", err);
    for (size_t i = 0; i < h->init_macros.n; i++) {
      const char *name = h->init_macros.v[i];
      const size_t n = strlen(name);
      int found = 0;
      for (const char *p = strstr(text, name); p && !found; p = strstr(p + 1, name))
        found = (p == text || !is_ident((unsigned char)p[-1])) && !is_ident((unsigned char)p[n]);
      if (!found) {
        print_error("%s does not use %s\n", arg_init_srcs.v[f], name);
        bad++;
      }
    }
    free(text);
  }
  if (bad) fail_msg("%d INIT macro(s) not exercised by the header checks", bad);
}

/* dlopen the library as a plugin host would and resolve every map symbol,
 * by name and by name@version. */
static void dlsym_every_map_symbol(void **state) {
  const map_info *m = need_map(state);
  void *h = dlopen(arg_lib, RTLD_NOW | RTLD_LOCAL);
  if (!h) fail_msg("dlopen(%s): %s", arg_lib, dlerror());
  int bad = 0;
  for (size_t i = 0; i < m->globals.n; i++) {
    dlerror();
    if (!dlsym(h, m->globals.v[i])) {
      print_error("dlsym(%s): %s\n", m->globals.v[i], dlerror());
      bad++;
    }
    if (!dlvsym(h, m->globals.v[i], m->owner.v[i])) {
      print_error("dlvsym(%s, %s): %s\n", m->globals.v[i], m->owner.v[i], dlerror());
      bad++;
    }
  }
  unsigned (*num)(void) = (unsigned (*)(void))dlsym(h, "kvi_version_number");
  const char *(*str)(void) = (const char *(*)(void))dlsym(h, "kvi_version_string");
  if (num) assert_int_equal(num(), KVI_VERSION_NUMBER);
  if (str) assert_string_equal(str(), KVI_VERSION_STRING);
  assert_int_equal(dlclose(h), 0);
  if (bad) fail_msg("%d symbol(s) could not be resolved with dlsym/dlvsym", bad);
}

/* The loaded library and the headers it was built with agree, and both agree
 * with the version Meson was configured with. */
static void runtime_version_matches_headers(void **state) {
  (void)state;
  char buf[64];
  assert_int_equal(kvi_version_number(), KVI_VERSION_NUMBER);
  assert_string_equal(kvi_version_string(), KVI_VERSION_STRING);
  assert_int_equal(KVI_VERSION_NUMBER, KVI_VERSION_MAJOR * 10000 + KVI_VERSION_MINOR * 100 + KVI_VERSION_PATCH);
  snprintf(buf, sizeof buf, "%d.%d.%d", KVI_VERSION_MAJOR, KVI_VERSION_MINOR, KVI_VERSION_PATCH);
  assert_string_equal(buf, KVI_VERSION_STRING);
  if (arg_version) assert_string_equal(KVI_VERSION_STRING, arg_version);
}

static void soname_is_versioned(void **state) {
  const elf_info *e = need_elf(state);
  if (!e->soname) fail_msg("%s has no DT_SONAME", arg_lib);
  assert_non_null(arg_soname);
  assert_string_equal(e->soname, arg_soname);
}

/* kvi_features() reports what Meson built in. */
static void features_match_build(void **state) {
  (void)state;
  int cuda, cublaslt, nccl;
  if (!arg_features || sscanf(arg_features, "%d,%d,%d", &cuda, &cublaslt, &nccl) != 3) skip();
  const unsigned f = kvi_features();
  assert_int_equal(!!(f & KVI_FEATURE_CUDA), cuda);
  assert_int_equal(!!(f & KVI_FEATURE_CUBLASLT), cublaslt);
  assert_int_equal(!!(f & KVI_FEATURE_NCCL), nccl);
  assert_int_equal(f & ~(KVI_FEATURE_CUDA | KVI_FEATURE_CUBLASLT | KVI_FEATURE_NCCL), 0);
  int count = -1;
  const kvi_status st = kvi_cuda_device_count(&count);
  if (cuda) {
    assert_int_equal(st, KVI_OK);
    assert_true(count >= 0);
  } else {
    assert_int_equal(st, KVI_ERR_NOT_BUILT);
    assert_int_equal(count, 0);
  }
}

/* The CUDA runtime is linked statically and cuBLASLt and NCCL are opened on
 * first use (meson.build): the library must load where none of them is
 * installed, and must be position-independent. */
static void no_dynamic_cudart_no_textrel(void **state) {
  const elf_info *e = need_elf(state);
  static const char *const optional[] = {"libcudart.so", "libcublas", "libnccl.so"};
  for (size_t i = 0; i < e->needed.n; i++)
    for (size_t j = 0; j < sizeof optional / sizeof optional[0]; j++)
      if (strncmp(e->needed.v[i], optional[j], strlen(optional[j])) == 0)
        fail_msg("DT_NEEDED %s: the library must load without it (linked statically or opened on first use)",
                 e->needed.v[i]);
  if (e->textrel) fail_msg("%s has text relocations", arg_lib);
}

int main(int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
/* sizeof name counts the NUL: "--" name "=" is sizeof name + 2 characters */
#define OPT(name, var)                                  \
  if (strncmp(a, "--" name "=", sizeof name + 2) == 0) { \
    var = a + sizeof name + 2;                          \
    continue;                                           \
  }
    OPT("lib", arg_lib)
    OPT("map", arg_map)
    OPT("include", arg_include)
    OPT("soname", arg_soname)
    OPT("version", arg_version)
    OPT("features", arg_features)
#undef OPT
    if (strncmp(a, "--init-src=", 11) == 0) {
      sl_push(&arg_init_srcs, a + 11);
      continue;
    }
    fprintf(stderr, "%s: unknown argument %s\n", argv[0], a);
    return 2;
  }
  if (!arg_lib || !arg_map || !arg_include) {
    fprintf(stderr, "usage: %s --lib=LIB --map=MAP --include=DIR [--soname=S] [--version=V] "
                    "[--features=C,B,N] [--init-src=FILE]...\n", argv[0]);
    return 2;
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(exports_match_map),
      cmocka_unit_test(exports_have_prefix),
      cmocka_unit_test(symbol_versions_match_map),
      cmocka_unit_test(map_matches_headers),
      cmocka_unit_test(init_macros_used_by_header_checks),
      cmocka_unit_test(dlsym_every_map_symbol),
      cmocka_unit_test(runtime_version_matches_headers),
      cmocka_unit_test(soname_is_versioned),
      cmocka_unit_test(features_match_build),
      cmocka_unit_test(no_dynamic_cudart_no_textrel),
  };
  const int rc = cmocka_run_group_tests_name("abi", tests, group_setup, group_teardown);
  sl_free(&arg_init_srcs);
  return rc;
}
