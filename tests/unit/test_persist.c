/*
 * unit-persist: store files (kvi_store_save, kvi_store_load) and the journal.
 * SPDX-License-Identifier: Apache-2.0
 *
 * References are independent of the library: every fact's K/V is a function
 * of a tag (tag_value), its expected stored bits come from unit.h's own
 * rounding, and the file layout is checked by a parser and a bitwise CRC32C
 * written here from docs/architecture.md. The crash tests fork a child that
 * journals or saves, SIGKILL it at random moments, and check that the file
 * then holds exactly the acknowledged changes (or those plus the one in
 * flight).
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "unit.h"

/* ------------------------------------------------------------------------ */
/* geometry, facts, reference states                                        */
/* ------------------------------------------------------------------------ */

typedef struct geo {
  int32_t L, Hkv, D, tp_rank, tp_size, H; /* H: local heads */
  kvi_dtype dt;
  int32_t E, P;
  uint64_t budget;
} geo;

/* L=2, 4 KV heads over tp 2 (rank 1 holds heads 2..3), head 8, bf16,
 * 3-element embeddings, pages of 4 tokens. */
static geo small_geo(void) {
  geo g = {2, 4, 8, 1, 2, 2, KVI_DTYPE_BF16, 3, 4, 256u * 1024u};
  return g;
}

#define EMB_SALT 0x5eedULL

/* A model for g with a non-trivial RoPE: NeoX llama3 on layer 0, NoPE on
 * the last layer. */
static kvi_model *geo_model(const geo *g) {
  kvi_model *m = make_model(g->L, g->Hkv, g->D, g->tp_rank, g->tp_size);
  kvi_rope_spec r = KVI_ROPE_SPEC_INIT;
  r.theta = 500000.0;
  r.scaling = KVI_ROPE_SCALING_LLAMA3;
  r.factor = 8.0;
  assert_ok(kvi_model_set_rope(m, -1, &r));
  kvi_rope_spec none = KVI_ROPE_SPEC_INIT;
  none.style = KVI_ROPE_NONE;
  if (g->L > 1) assert_ok(kvi_model_set_rope(m, g->L - 1, &none));
  return m;
}

static kvi_store_options geo_opts(const geo *g) {
  kvi_store_options o = cpu_store_options(g->dt, g->P, g->budget);
  o.embedding_dim = g->E;
  return o;
}

static kvi_store *geo_store(const geo *g, const kvi_model *m) {
  kvi_store_options o = geo_opts(g);
  kvi_store *s = NULL;
  assert_ok(kvi_store_create(&s, m, &o));
  return s;
}

static int64_t fact_elems(const geo *g, int32_t T) { return 2 * (int64_t)g->L * T * g->H * g->D; }

/* Puts fact (tenant, id) of T tokens whose K/V and embedding derive from tag. */
static kvi_status put_tag(kvi_store *s, const geo *g, uint64_t tenant, uint64_t id, int32_t T, uint64_t tag,
                          uint32_t flags) {
  kvbuf b;
  kvbuf_make(&b, LAYOUT_CONTIG, KVI_DTYPE_FP32, g->L, T, g->H, g->D);
  kvbuf_fill_tag(&b, tag);
  float emb[16];
  for (int i = 0; i < g->E; i++) emb[i] = tag_value(tag ^ EMB_SALT, i);
  kvi_put_options po = KVI_PUT_OPTIONS_INIT;
  po.flags = flags;
  po.embedding = g->E ? emb : NULL;
  const kvi_status st = kvi_store_put(s, tenant, id, &b.v, &po, NULL);
  kvbuf_free(&b);
  return st;
}

/* NULL when (tenant, id) holds T tokens made from tag, else what differs. */
static const char *fact_differs(const kvi_store *s, const geo *g, uint64_t tenant, uint64_t id, int32_t T,
                                uint64_t tag) {
  static _Thread_local char why[256];
  int32_t t = -1;
  if (kvi_store_fact_tokens(s, tenant, id, &t) != KVI_OK) {
    snprintf(why, sizeof why, "fact %llu/%llu missing", (unsigned long long)tenant, (unsigned long long)id);
    return why;
  }
  if (t != T) {
    snprintf(why, sizeof why, "fact %llu/%llu has %d tokens, expected %d", (unsigned long long)tenant,
             (unsigned long long)id, (int)t, (int)T);
    return why;
  }
  const int64_t n = fact_elems(g, T), es = (int64_t)kvi_dtype_size(g->dt);
  unsigned char *buf = malloc((size_t)(n * es));
  assert_non_null(buf);
  kvi_kv_view v;
  kvi_kv_view_contiguous(&v, KVI_MEMORY_HOST, g->dt, g->L, T, g->H, g->D, buf, buf + n / 2 * es);
  const char *res = NULL;
  if (kvi_store_read(s, tenant, id, &v, NULL) != KVI_OK) {
    snprintf(why, sizeof why, "reading %llu/%llu: %s", (unsigned long long)tenant, (unsigned long long)id,
             kvi_last_error());
    res = why;
  }
  for (int64_t i = 0; i < n && !res; i++)
    if (load_bits(buf, g->dt, i) != ref_bits(tag_value(tag, i), g->dt)) {
      snprintf(why, sizeof why, "fact %llu/%llu element %lld: 0x%x, expected 0x%x", (unsigned long long)tenant,
               (unsigned long long)id, (long long)i, load_bits(buf, g->dt, i), ref_bits(tag_value(tag, i), g->dt));
      res = why;
    }
  free(buf);
  if (!res && g->E) {
    float emb[16];
    if (kvi_store_get_embedding(s, tenant, id, emb) != KVI_OK) {
      snprintf(why, sizeof why, "embedding of %llu/%llu: %s", (unsigned long long)tenant, (unsigned long long)id,
               kvi_last_error());
      return why;
    }
    for (int i = 0; i < g->E; i++)
      if (f2u(emb[i]) != f2u(tag_value(tag ^ EMB_SALT, i))) {
        snprintf(why, sizeof why, "fact %llu/%llu embedding[%d] differs", (unsigned long long)tenant,
                 (unsigned long long)id, i);
        return why;
      }
  }
  return res;
}

/* The reference: a fixed set of keys, each present or not. */
#define NSLOT 24
typedef struct rstate {
  bool present[NSLOT];
  int32_t tokens[NSLOT];
  uint64_t tag[NSLOT];
} rstate;

static uint64_t slot_tenant(int s) { return s % 3 == 2 ? UINT64_MAX - 1 : (uint64_t)(s % 3) + 1; }
static uint64_t slot_id(int s) { return (uint64_t)s * 1000003u + (s % 2 ? (1ull << 40) : 0); }

static int rstate_count(const rstate *r) {
  int n = 0;
  for (int s = 0; s < NSLOT; s++) n += r->present[s];
  return n;
}

/* NULL when the store holds exactly the reference's facts. */
static const char *state_differs(const kvi_store *st, const geo *g, const rstate *r) {
  static _Thread_local char why[320];
  for (int s = 0; s < NSLOT; s++) {
    if (r->present[s]) {
      const char *d = fact_differs(st, g, slot_tenant(s), slot_id(s), r->tokens[s], r->tag[s]);
      if (d) return d;
    } else {
      int32_t t;
      if (kvi_store_fact_tokens(st, slot_tenant(s), slot_id(s), &t) != KVI_ERR_NOT_FOUND) {
        snprintf(why, sizeof why, "fact %llu/%llu (slot %d) is stored but should not be",
                 (unsigned long long)slot_tenant(s), (unsigned long long)slot_id(s), s);
        return why;
      }
    }
  }
  kvi_store_stats ss = KVI_STORE_STATS_INIT;
  if (kvi_store_stats_get(st, &ss) != KVI_OK || ss.facts != (uint64_t)rstate_count(r)) {
    snprintf(why, sizeof why, "the store holds %llu facts, the reference %d", (unsigned long long)ss.facts,
             rstate_count(r));
    return why;
  }
  return NULL;
}

#define assert_state(store, g, r)                                          \
  do {                                                                     \
    const char *d_ = state_differs((store), (g), (r));                     \
    if (d_) fail_msg("%s:%d: store differs from the reference: %s", __FILE__, __LINE__, d_); \
  } while (0)

/* ------------------------------------------------------------------------ */
/* files                                                                    */
/* ------------------------------------------------------------------------ */

typedef struct fx {
  char dir[256];
  char path[300];
} fx;

static int fx_setup(void **state) {
  fx *f = calloc(1, sizeof *f);
  const char *tmp = getenv("TMPDIR");
  snprintf(f->dir, sizeof f->dir, "%s/kvi-persist-XXXXXX", tmp && *tmp ? tmp : "/tmp");
  if (!mkdtemp(f->dir)) return -1;
  snprintf(f->path, sizeof f->path, "%s/facts.kvi", f->dir);
  *state = f;
  return 0;
}

static int dir_count(const char *dir, const char *prefix) {
  DIR *d = opendir(dir);
  if (!d) return -1;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)))
    if (e->d_name[0] != '.' && strncmp(e->d_name, prefix, strlen(prefix)) == 0) n++;
  closedir(d);
  return n;
}

static int fx_teardown(void **state) {
  fx *f = *state;
  DIR *d = opendir(f->dir);
  if (d) {
    struct dirent *e;
    char p[600];
    while ((e = readdir(d)))
      if (e->d_name[0] != '.') {
        snprintf(p, sizeof p, "%s/%s", f->dir, e->d_name);
        unlink(p);
      }
    closedir(d);
  }
  rmdir(f->dir);
  free(f);
  return 0;
}

static unsigned char *read_all(const char *path, size_t *n) {
  FILE *fp = fopen(path, "rb");
  assert_non_null(fp);
  fseek(fp, 0, SEEK_END);
  const long len = ftell(fp);
  fseek(fp, 0, SEEK_SET);
  unsigned char *b = malloc((size_t)len + 1);
  assert_non_null(b);
  assert_int_equal(fread(b, 1, (size_t)len, fp), (size_t)len);
  fclose(fp);
  *n = (size_t)len;
  return b;
}

static void write_all_file(const char *path, const void *b, size_t n) {
  FILE *fp = fopen(path, "wb");
  assert_non_null(fp);
  if (n) assert_int_equal(fwrite(b, 1, n, fp), n);
  assert_int_equal(fclose(fp), 0);
}

static kvi_status load(kvi_store **out, const geo *g, const kvi_model *m, const char *path, uint32_t flags) {
  kvi_store_options o = geo_opts(g);
  kvi_load_options lo = KVI_LOAD_OPTIONS_INIT;
  lo.flags = flags;
  return kvi_store_load(out, m, &o, path, &lo);
}

/* Loads `path` and checks it against r. */
static void assert_file_state(const geo *g, const kvi_model *m, const char *path, const rstate *r) {
  kvi_store *s = NULL;
  assert_ok(load(&s, g, m, path, 0));
  assert_state(s, g, r);
  kvi_store_destroy(s);
}

/* ------------------------------------------------------------------------ */
/* an independent reader of the documented format                           */
/* ------------------------------------------------------------------------ */

static uint32_t ref_crc32c(uint32_t crc, const void *data, size_t n) {
  const unsigned char *p = data;
  crc = ~crc;
  for (size_t i = 0; i < n; i++) {
    crc ^= p[i];
    for (int k = 0; k < 8; k++) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
  }
  return ~crc;
}

static uint32_t rd32(const unsigned char *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t rd64(const unsigned char *p) { return (uint64_t)rd32(p) | (uint64_t)rd32(p + 4) << 32; }
static double rdf64(const unsigned char *p) {
  const uint64_t u = rd64(p);
  double d;
  memcpy(&d, &u, 8);
  return d;
}

typedef struct pentry {
  uint64_t off, body;
  uint32_t kind, count;
} pentry;

/* Parses a whole, undamaged file as docs/architecture.md describes it;
 * returns the number of entries (the END entry included). */
static int parse_file(const unsigned char *b, size_t n, const geo *g, pentry *out, int max) {
  assert_true(n >= 92);
  assert_memory_equal(b, "KVISTORE", 8);
  assert_int_equal(rd32(b + 8), 4);
  assert_int_equal(rd32(b + 12), 0x01020304u);
  const uint32_t hb = rd32(b + 16);
  assert_int_equal(hb, 88 + 88 * (uint32_t)g->L + 4);
  assert_int_equal(rd32(b + hb - 4), ref_crc32c(0, b, hb - 4));
  assert_int_equal(rd32(b + 20), 0);
  const uint64_t file_id = rd64(b + 24);
  const int32_t want[8] = {g->L, g->Hkv, g->D, g->tp_rank, g->tp_size, g->tp_rank * g->H, g->H, 1};
  for (int i = 0; i < 8; i++) assert_int_equal((int32_t)rd32(b + 32 + 4 * i), want[i]);
  assert_int_equal(rd32(b + 64), g->dt);
  assert_int_equal(rd32(b + 68), g->E);
  assert_int_equal(rd32(b + 72), KVI_DTYPE_FP32);
  assert_int_equal(rd32(b + 80), 88);
  int ne = 0;
  uint64_t pos = hb;
  bool ended = false;
  uint64_t facts = 0;
  uint32_t chain = 0;
  while (pos < n) {
    assert_true(pos + 48 <= n);
    const unsigned char *h = b + pos;
    assert_int_equal(rd32(h), 0x4549564Bu);
    assert_int_equal(rd32(h + 44), ref_crc32c(0, h, 44));
    assert_true(rd64(h + 8) == file_id);
    assert_int_equal(rd64(h + 16), (uint64_t)ne);
    const uint64_t body = rd64(h + 24);
    assert_true(pos + 48 + body <= n);
    assert_int_equal(rd32(h + 40), ref_crc32c(0, h + 48, (size_t)body));
    const uint32_t kind = rd32(h + 4), count = rd32(h + 32);
    if (kind == 2) {
      assert_false(ended);
      assert_int_equal(body, 24);
      assert_int_equal(rd64(h + 48), facts);
      assert_int_equal(rd32(h + 48 + 16), chain);
      ended = true;
    } else {
      assert_int_equal(kind, 1);
      uint64_t at = 0;
      for (uint32_t i = 0; i < count; i++) {
        const unsigned char *r = h + 48 + at;
        const uint32_t op = rd32(r);
        const uint64_t payload = rd64(r + 24);
        if (op == 1)
          assert_int_equal(payload, (uint64_t)g->E * 4 + (uint64_t)rd32(r + 4) * 2 * g->L * g->H * g->D *
                                                              kvi_dtype_size(g->dt));
        else
          assert_true(op == 2 && payload == 0);
        at += 32 + ((payload + 7) & ~7ull);
      }
      assert_int_equal(at, body);
      if (!ended) {
        facts += count;
        unsigned char c4[4] = {(unsigned char)rd32(h + 40), (unsigned char)(rd32(h + 40) >> 8),
                               (unsigned char)(rd32(h + 40) >> 16), (unsigned char)(rd32(h + 40) >> 24)};
        chain = ref_crc32c(chain, c4, 4);
      }
    }
    if (ne < max) out[ne] = (pentry){pos, body, kind, count};
    ne++;
    pos += 48 + body;
  }
  assert_true(ended);
  return ne;
}

/* ------------------------------------------------------------------------ */
/* save and load                                                            */
/* ------------------------------------------------------------------------ */

static void test_crc32c_reference(void **state) {
  (void)state;
  assert_int_equal(ref_crc32c(0, "123456789", 9), 0xE3069283u);
}

/* Random puts, replacements and removals; every dtype, with and without
 * embeddings; loaded with other page sizes; compared with the reference. */
static void test_roundtrip(void **state) {
  fx *f = *state;
  rng r;
  rng_seed(&r, __func__);
  for (int di = 0; di < 3; di++)
    for (int e = 0; e < 2; e++) {
      geo g = small_geo();
      g.dt = float_dtypes[di];
      g.E = e ? 5 : 0;
      kvi_model *m = geo_model(&g);
      kvi_store *s = geo_store(&g, m);
      rstate ref;
      memset(&ref, 0, sizeof ref);
      for (int op = 0; op < 60; op++) {
        const int sl = (int)rng_range(&r, 0, NSLOT - 1);
        if (ref.present[sl] && rng_range(&r, 0, 2) == 0) {
          assert_ok(kvi_store_remove(s, slot_tenant(sl), slot_id(sl)));
          ref.present[sl] = false;
          continue;
        }
        const int32_t T = (int32_t)rng_range(&r, 1, 13);
        const uint64_t tag = rng_next(&r);
        assert_ok(put_tag(s, &g, slot_tenant(sl), slot_id(sl), T, tag, ref.present[sl] ? KVI_PUT_REPLACE : 0));
        ref.present[sl] = true, ref.tokens[sl] = T, ref.tag[sl] = tag;
      }
      assert_state(s, &g, &ref);
      assert_ok(kvi_store_save(s, f->path, NULL));
      assert_int_equal(dir_count(f->dir, "facts.kvi.tmp"), 0);
      /* the documented layout, checked independently */
      size_t n;
      unsigned char *b = read_all(f->path, &n);
      pentry pe[NSLOT + 1];
      assert_int_equal(parse_file(b, n, &g, pe, NSLOT + 1), rstate_count(&ref) + 1);
      free(b);
      /* other page sizes and budgets */
      const int32_t pages[] = {1, 3, 16};
      for (int p = 0; p < 3; p++) {
        geo g2 = g;
        g2.P = pages[p];
        kvi_store *l = NULL;
        assert_ok(load(&l, &g2, m, f->path, 0));
        assert_state(l, &g2, &ref);
        kvi_store_stats a = store_stats(s), c = store_stats(l);
        assert_int_equal(a.bytes_payload, c.bytes_payload);
        assert_int_equal(a.tenants, c.tenants);
        kvi_store_destroy(l);
      }
      kvi_store_destroy(s);
      kvi_model_destroy(m);
    }
}

/* The records carry exactly the stored bytes: the payload of a fact is its
 * embedding, then K [L][T][H][D], then V, in the store's dtype. */
static void test_record_payload_bytes(void **state) {
  fx *f = *state;
  geo g = small_geo();
  g.dt = KVI_DTYPE_FP16;
  kvi_model *m = geo_model(&g);
  kvi_store *s = geo_store(&g, m);
  const int32_t T = 5;
  assert_ok(put_tag(s, &g, 9, 99, T, 1234, 0));
  assert_ok(kvi_store_save(s, f->path, NULL));
  size_t n;
  unsigned char *b = read_all(f->path, &n);
  pentry pe[2];
  assert_int_equal(parse_file(b, n, &g, pe, 2), 2);
  const unsigned char *rec = b + pe[0].off + 48;
  assert_int_equal(rd32(rec), 1);
  assert_int_equal(rd32(rec + 4), T);
  assert_int_equal(rd64(rec + 8), 9);
  assert_int_equal(rd64(rec + 16), 99);
  const unsigned char *p = rec + 32;
  for (int i = 0; i < g.E; i++) assert_int_equal(rd32(p + 4 * i), f2u(tag_value(1234 ^ EMB_SALT, i)));
  p += 4 * g.E;
  for (int64_t i = 0; i < fact_elems(&g, T); i++)
    assert_int_equal((uint32_t)p[2 * i] | (uint32_t)p[2 * i + 1] << 8, ref_bits(tag_value(1234, i), g.dt));
  /* layer 0: llama3 RoPE as resolved; the last layer: NoPE */
  const unsigned char *r0 = b + 88, *r1 = b + 88 + 88;
  assert_int_equal(rd32(r0), KVI_ROPE_NEOX);
  assert_int_equal(rd32(r0 + 4), g.D);
  assert_int_equal(rd32(r0 + 8), KVI_ROPE_SCALING_LLAMA3);
  assert_true(rdf64(r0 + 16) == 500000.0 && rdf64(r0 + 24) == 8.0 && rdf64(r0 + 64) == 1.0);
  assert_int_equal(rd32(r1), KVI_ROPE_NONE);
  free(b);
  kvi_store_destroy(s);
  kvi_model_destroy(m);
}

static void test_save_one_tenant_and_empty(void **state) {
  fx *f = *state;
  geo g = small_geo();
  kvi_model *m = geo_model(&g);
  kvi_store *s = geo_store(&g, m);
  rstate all, one, none;
  memset(&all, 0, sizeof all);
  memset(&none, 0, sizeof none);
  for (int sl = 0; sl < NSLOT; sl += 2) {
    assert_ok(put_tag(s, &g, slot_tenant(sl), slot_id(sl), 1 + sl % 7, 77 + sl, 0));
    all.present[sl] = true, all.tokens[sl] = 1 + sl % 7, all.tag[sl] = 77 + (uint64_t)sl;
  }
  one = all;
  for (int sl = 0; sl < NSLOT; sl++)
    if (slot_tenant(sl) != UINT64_MAX - 1) one.present[sl] = false;
  kvi_save_options so = KVI_SAVE_OPTIONS_INIT;
  so.flags = KVI_SAVE_ONE_TENANT;
  so.tenant = UINT64_MAX - 1;
  assert_ok(kvi_store_save(s, f->path, &so));
  assert_file_state(&g, m, f->path, &one);
  so.tenant = 12345; /* no facts: a valid, empty file */
  assert_ok(kvi_store_save(s, f->path, &so));
  assert_file_state(&g, m, f->path, &none);
  assert_ok(kvi_store_save(s, f->path, NULL));
  assert_file_state(&g, m, f->path, &all);
  kvi_store *empty = geo_store(&g, m);
  assert_ok(kvi_store_save(empty, f->path, NULL));
  assert_file_state(&g, m, f->path, &none);
  kvi_store_destroy(empty);
  kvi_store_destroy(s);
  kvi_model_destroy(m);
}

/* A file for another geometry, tp slice, dtype, embedding size or RoPE is
 * refused with KVI_ERR_INCOMPATIBLE naming the field; a RoPE resolved the
 * same from another spec is accepted. */
static void test_incompatible(void **state) {
  fx *f = *state;
  geo g = small_geo();
  kvi_model *m = geo_model(&g);
  kvi_store *s = geo_store(&g, m);
  assert_ok(put_tag(s, &g, 1, 1, 3, 5, 0));
  assert_ok(kvi_store_save(s, f->path, NULL));
  kvi_store *l = (kvi_store *)(uintptr_t)0x1; /* must stay untouched */
  struct {
    int32_t L, Hkv, D, r, tp;
    const char *needle;
  } cases[] = {
      {3, 4, 8, 1, 2, "num_layers 2"}, {2, 8, 8, 1, 2, "num_kv_heads 4"}, {2, 4, 16, 1, 2, "head_size 8"},
      {2, 4, 8, 0, 2, "tp_rank 1"},    {2, 4, 8, 1, 4, "tp_size 2"},      {2, 4, 8, 0, 1, "tp_rank 1"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    kvi_model *o = make_model(cases[i].L, cases[i].Hkv, cases[i].D, cases[i].r, cases[i].tp);
    kvi_store_options so = geo_opts(&g);
    assert_status(kvi_store_load(&l, o, &so, f->path, NULL), KVI_ERR_INCOMPATIBLE);
    assert_last_error_has("kvi_store_load", cases[i].needle);
    assert_ptr_equal(l, (kvi_store *)(uintptr_t)0x1);
    kvi_model_destroy(o);
  }
  { /* options the file does not pin, refused by the store's creation: the message names kvi_store_load */
    kvi_store_options so = geo_opts(&g);
    so.page_tokens = 5000;
    assert_status(kvi_store_load(&l, m, &so, f->path, NULL), KVI_ERR_INVALID_ARGUMENT);
    assert_int_equal(strncmp(kvi_last_error(), "kvi_store_load: ", 16), 0);
    assert_ptr_equal(l, (kvi_store *)(uintptr_t)0x1);
  }
  /* dtype and embedding size */
  geo g2 = g;
  g2.dt = KVI_DTYPE_FP16;
  assert_status(load(&l, &g2, m, f->path, 0), KVI_ERR_INCOMPATIBLE);
  assert_last_error_has("kvi_store_load", "bf16 facts, opts->dtype is fp16");
  g2 = g;
  g2.E = 4;
  assert_status(load(&l, &g2, m, f->path, 0), KVI_ERR_INCOMPATIBLE);
  assert_last_error_has("kvi_store_load", "embedding_dim is 4");
  /* RoPE: every field that changes the rotation */
  kvi_rope_spec base = KVI_ROPE_SPEC_INIT;
  base.theta = 500000.0;
  base.scaling = KVI_ROPE_SCALING_LLAMA3;
  base.factor = 8.0;
  struct {
    int field;
    const char *needle;
  } rc[] = {{0, "layer 0 RoPE style"}, {1, "layer 0 RoPE rotary_dim"}, {2, "layer 0 RoPE theta"},
            {3, "layer 0 RoPE factor"}, {4, "layer 0 RoPE high_freq_factor"}, {5, "layer 0 RoPE scaling"},
            {6, "layer 0 RoPE attention_factor"}, {7, "layer 0 RoPE original_max_position"}};
  for (size_t i = 0; i < sizeof rc / sizeof rc[0]; i++) {
    kvi_model *o = geo_model(&g);
    kvi_rope_spec x = base;
    switch (rc[i].field) {
    case 0: x.style = KVI_ROPE_GPTJ; break;
    case 1: x.rotary_dim = 4; break;
    case 2: x.theta = 10000.0; break;
    case 3: x.factor = 4.0; break;
    case 4: x.high_freq_factor = 5.0; break;
    case 5: x.scaling = KVI_ROPE_SCALING_LINEAR; break;
    case 6: x.attention_factor = 1.5; break;
    case 7: x.original_max_position = 4096; break;
    }
    assert_ok(kvi_model_set_rope(o, 0, &x));
    kvi_store_options so = geo_opts(&g);
    assert_status(kvi_store_load(&l, o, &so, f->path, NULL), KVI_ERR_INCOMPATIBLE);
    assert_last_error_has("kvi_store_load", rc[i].needle);
    kvi_model_destroy(o);
  }
  {
    /* a NoPE layer made rotary */
    kvi_model *o = geo_model(&g);
    assert_ok(kvi_model_set_rope(o, g.L - 1, &base));
    kvi_store_options so = geo_opts(&g);
    assert_status(kvi_store_load(&l, o, &so, f->path, NULL), KVI_ERR_INCOMPATIBLE);
    assert_last_error_has("kvi_store_load", "layer 1 RoPE style");
    kvi_model_destroy(o);
  }
  {
    /* the same rotation from another spec: explicit rotary_dim, fields llama3 ignores */
    kvi_model *o = geo_model(&g);
    kvi_rope_spec x = base;
    x.rotary_dim = g.D;
    x.beta_fast = 7.0;
    x.yarn_truncate = 0;
    assert_ok(kvi_model_set_rope(o, 0, &x));
    kvi_store_options so = geo_opts(&g);
    kvi_store *ok = NULL;
    assert_ok(kvi_store_load(&ok, o, &so, f->path, NULL));
    kvi_store_destroy(ok);
    kvi_model_destroy(o);
  }
  /* engine cos/sin tables: equal contents load, other contents do not */
  {
    const int32_t pos = 16, rot = g.D;
    float *tab = malloc((size_t)pos * rot * sizeof *tab);
    for (int i = 0; i < pos * rot; i++) tab[i] = (float)i * 0.01f;
    kvi_rope_spec t = KVI_ROPE_SPEC_INIT;
    t.cos_sin_table = tab;
    t.table_positions = pos;
    kvi_model *a = make_model(g.L, g.Hkv, g.D, g.tp_rank, g.tp_size);
    assert_ok(kvi_model_set_rope(a, -1, &t));
    kvi_store *sa = geo_store(&g, a);
    assert_ok(put_tag(sa, &g, 1, 1, 2, 5, 0));
    assert_ok(kvi_store_save(sa, f->path, NULL));
    kvi_store_destroy(sa);
    kvi_model *b = make_model(g.L, g.Hkv, g.D, g.tp_rank, g.tp_size);
    t.theta = 123.0; /* ignored with a table */
    assert_ok(kvi_model_set_rope(b, -1, &t));
    kvi_store_options so = geo_opts(&g);
    kvi_store *ok = NULL;
    assert_ok(kvi_store_load(&ok, b, &so, f->path, NULL));
    kvi_store_destroy(ok);
    tab[7] += 1.0f;
    assert_ok(kvi_model_set_rope(b, 1, &t));
    assert_status(kvi_store_load(&l, b, &so, f->path, NULL), KVI_ERR_INCOMPATIBLE);
    assert_last_error_has("kvi_store_load", "layer 1 RoPE cos_sin_table");
    t.table_positions = pos - 1;
    assert_ok(kvi_model_set_rope(b, 1, &t));
    assert_status(kvi_store_load(&l, b, &so, f->path, NULL), KVI_ERR_INCOMPATIBLE);
    assert_last_error_has("kvi_store_load", "table_positions is 16 in the file, 15");
    kvi_model_destroy(a);
    kvi_model_destroy(b);
    free(tab);
  }
  assert_ptr_equal(l, (kvi_store *)(uintptr_t)0x1);
  kvi_store_destroy(s);
  kvi_model_destroy(m);
}

/* Arguments, missing files, budgets; *out untouched on every error. */
static void test_load_errors(void **state) {
  fx *f = *state;
  geo g = small_geo();
  kvi_model *m = geo_model(&g);
  kvi_store *s = geo_store(&g, m);
  for (int i = 0; i < 10; i++) assert_ok(put_tag(s, &g, 1, (uint64_t)i, 9, (uint64_t)i, 0));
  assert_ok(kvi_store_save(s, f->path, NULL));
  kvi_store_options so = geo_opts(&g);
  kvi_store *const sentinel = (kvi_store *)(uintptr_t)0x2;
  kvi_store *l = sentinel;
  assert_status(kvi_store_load(NULL, m, &so, f->path, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_store_load(&l, NULL, &so, f->path, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_store_load", "model is NULL");
  assert_status(kvi_store_load(&l, m, NULL, f->path, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_store_load(&l, m, &so, NULL, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_store_load(&l, m, &so, "", NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_store_load", "path is empty");
  char missing[400];
  snprintf(missing, sizeof missing, "%s/none.kvi", f->dir);
  assert_status(kvi_store_load(&l, m, &so, missing, NULL), KVI_ERR_NOT_FOUND);
  assert_last_error_has("kvi_store_load", missing);
  assert_status(kvi_store_load(&l, m, &so, f->dir, NULL), KVI_ERR_IO);
  assert_last_error_has("kvi_store_load", "not a regular file");
  kvi_load_options lo = KVI_LOAD_OPTIONS_INIT;
  lo.flags = 0x80;
  assert_status(kvi_store_load(&l, m, &so, f->path, &lo), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_store_load", "0x80");
  lo.flags = 0;
  lo.struct_size = 4;
  assert_status(kvi_store_load(&l, m, &so, f->path, &lo), KVI_ERR_STRUCT_SIZE);
  struct {
    kvi_load_options o;
    uint64_t extra;
  } big = {KVI_LOAD_OPTIONS_INIT, 1};
  big.o.struct_size = sizeof big;
  assert_status(kvi_store_load(&l, m, &so, f->path, &big.o), KVI_ERR_STRUCT_SIZE);
  big.extra = 0;
  kvi_store *ok = NULL;
  assert_ok(kvi_store_load(&ok, m, &so, f->path, &big.o)); /* zero bytes past the known fields are fine */
  kvi_store_destroy(ok);
  kvi_store_options bad = so;
  bad.dtype = (kvi_dtype)77;
  assert_status(kvi_store_load(&l, m, &bad, f->path, NULL), KVI_ERR_INVALID_ARGUMENT);
  bad = so;
  bad.page_tokens = 0; /* kvi_store_create's own checks */
  assert_status(kvi_store_load(&l, m, &bad, f->path, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_store_load", "page_tokens");
  /* 10 facts of 9 tokens need 30 pages of 4 tokens */
  bad = so;
  const uint64_t page = (uint64_t)2 * g.L * g.H * g.D * g.P * 2;
  bad.budget_bytes = 29 * page;
  assert_status(kvi_store_load(&l, m, &bad, f->path, NULL), KVI_ERR_CAPACITY);
  assert_last_error_has("kvi_store_load", "budget_bytes");
  bad.budget_bytes = 30 * page;
  assert_ok(kvi_store_load(&ok, m, &bad, f->path, NULL));
  kvi_store_destroy(ok);
  assert_ptr_equal(l, sentinel);
  kvi_store_destroy(s);
  kvi_model_destroy(m);
}

/* Failed saves leave the previous file and no temporary file. */
static void test_save_errors(void **state) {
  fx *f = *state;
  geo g = small_geo();
  kvi_model *m = geo_model(&g);
  kvi_store *s = geo_store(&g, m);
  rstate ref;
  memset(&ref, 0, sizeof ref);
  assert_ok(put_tag(s, &g, slot_tenant(0), slot_id(0), 3, 1, 0));
  ref.present[0] = true, ref.tokens[0] = 3, ref.tag[0] = 1;
  assert_ok(kvi_store_save(s, f->path, NULL));
  for (int i = 1; i < 12; i++) assert_ok(put_tag(s, &g, slot_tenant(i), slot_id(i), 13, 100 + (uint64_t)i, 0));

  assert_status(kvi_store_save(NULL, f->path, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_store_save(s, NULL, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_store_save(s, "", NULL), KVI_ERR_INVALID_ARGUMENT);
  kvi_save_options so = KVI_SAVE_OPTIONS_INIT;
  so.flags = 2;
  assert_status(kvi_store_save(s, f->path, &so), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_store_save", "0x2");
  so.flags = 0;
  so.struct_size = 3;
  assert_status(kvi_store_save(s, f->path, &so), KVI_ERR_STRUCT_SIZE);
  char p[400];
  snprintf(p, sizeof p, "%s/no/such/dir.kvi", f->dir);
  assert_status(kvi_store_save(s, p, NULL), KVI_ERR_IO);
  assert_last_error_has("kvi_store_save", "no/such/dir.kvi.tmp.");
  /* the path is a directory: the rename fails */
  snprintf(p, sizeof p, "%s/adir", f->dir);
  assert_int_equal(mkdir(p, 0700), 0);
  assert_status(kvi_store_save(s, p, NULL), KVI_ERR_IO);
  assert_last_error_has("kvi_store_save", "renaming");
  assert_int_equal(rmdir(p), 0);
  /* the file system refuses to grow the file: EFBIG half way */
  struct rlimit old, lim;
  assert_int_equal(getrlimit(RLIMIT_FSIZE, &old), 0);
  void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
  lim = old;
  lim.rlim_cur = 2000;
  assert_int_equal(setrlimit(RLIMIT_FSIZE, &lim), 0);
  const kvi_status st = kvi_store_save(s, f->path, NULL);
  assert_int_equal(setrlimit(RLIMIT_FSIZE, &old), 0);
  signal(SIGXFSZ, prev);
  assert_status(st, KVI_ERR_IO);
  assert_last_error_has("kvi_store_save", "writing");
  assert_int_equal(dir_count(f->dir, "facts.kvi.tmp"), 0);
  assert_file_state(&g, m, f->path, &ref);
  kvi_store_destroy(s);
  kvi_model_destroy(m);
}

/* ------------------------------------------------------------------------ */
/* damaged files                                                            */
/* ------------------------------------------------------------------------ */

/* A small journaled file: a snapshot of 3 facts, then `nops` changes; the
 * file size after journal_open and after each change, and the reference
 * state after each prefix of changes. */
typedef struct jfile {
  geo g;
  kvi_model *m;
  int nops;
  uint64_t size[16];  /* size[k]: after k changes */
  rstate state[16];   /* state[k]: after k changes */
} jfile;

static void jfile_make(jfile *j, const char *path) {
  j->g = small_geo();
  j->g.L = 1;
  j->g.D = 4;
  j->g.dt = KVI_DTYPE_FP16;
  j->g.E = 3;
  j->m = geo_model(&j->g);
  kvi_store *s = geo_store(&j->g, j->m);
  rstate r;
  memset(&r, 0, sizeof r);
  for (int sl = 0; sl < 3; sl++) {
    assert_ok(put_tag(s, &j->g, slot_tenant(sl), slot_id(sl), 2 + sl, 10 + (uint64_t)sl, 0));
    r.present[sl] = true, r.tokens[sl] = 2 + sl, r.tag[sl] = 10 + (uint64_t)sl;
  }
  assert_ok(kvi_store_journal_open(s, path, 0));
  j->state[0] = r;
  j->size[0] = file_size(path);
  /* put, replace, remove, put, remove, replace */
  const struct {
    int slot, op; /* 0 put, 1 remove */
    int32_t T;
  } ops[] = {{4, 0, 3}, {1, 0, 1}, {0, 1, 0}, {5, 0, 2}, {4, 1, 0}, {2, 0, 5}};
  j->nops = 6;
  for (int k = 0; k < j->nops; k++) {
    const int sl = ops[k].slot;
    if (ops[k].op == 1) {
      assert_ok(kvi_store_remove(s, slot_tenant(sl), slot_id(sl)));
      r.present[sl] = false;
    } else {
      const uint64_t tag = 1000 + (uint64_t)k;
      assert_ok(put_tag(s, &j->g, slot_tenant(sl), slot_id(sl), ops[k].T, tag, r.present[sl] ? KVI_PUT_REPLACE : 0));
      r.present[sl] = true, r.tokens[sl] = ops[k].T, r.tag[sl] = tag;
    }
    j->state[k + 1] = r;
    j->size[k + 1] = file_size(path);
    assert_true(j->size[k + 1] > j->size[k]);
  }
  kvi_store_destroy(s); /* closes the journal */
}

/* Which state a file cut at `len` bytes holds: -1 (corrupt) inside the
 * snapshot, else the number of complete changes. */
static int cut_state(const jfile *j, uint64_t len) {
  if (len < j->size[0]) return -1;
  int k = 0;
  while (k < j->nops && j->size[k + 1] <= len) k++;
  return k;
}

/* Every truncation: inside the snapshot, KVI_ERR_CORRUPT; inside the log,
 * the changes complete before the cut. */
static void test_truncated_everywhere(void **state) {
  fx *f = *state;
  jfile j;
  jfile_make(&j, f->path);
  size_t n;
  unsigned char *b = read_all(f->path, &n);
  assert_int_equal(n, j.size[j.nops]);
  char cut[400];
  snprintf(cut, sizeof cut, "%s/cut.kvi", f->dir);
  int corrupt = 0, prefix = 0;
  for (size_t len = 0; len <= n; len++) {
    write_all_file(cut, b, len);
    kvi_store *s = NULL;
    const kvi_status st = load(&s, &j.g, j.m, cut, 0);
    const int want = cut_state(&j, len);
    if (want < 0) {
      if (st != KVI_ERR_CORRUPT)
        fail_msg("cut at %zu of %zu (snapshot ends at %llu): status %d (%s), expected corrupt", len, n,
                 (unsigned long long)j.size[0], (int)st, kvi_last_error());
      assert_null(s);
      corrupt++;
    } else {
      if (st != KVI_OK) fail_msg("cut at %zu of %zu: status %d: %s", len, n, (int)st, kvi_last_error());
      const char *d = state_differs(s, &j.g, &j.state[want]);
      if (d) fail_msg("cut at %zu: expected the state after %d changes: %s", len, want, d);
      kvi_store_destroy(s);
      prefix++;
    }
  }
  print_message("    %d cuts refused as corrupt, %d loaded a prefix of the log\n", corrupt, prefix);
  free(b);
  kvi_model_destroy(j.m);
}

/* One flipped bit in every byte: refused as corrupt, except in the last
 * entry, which is indistinguishable from a torn write and dropped. */
static void test_bit_flips_everywhere(void **state) {
  fx *f = *state;
  rng r;
  rng_seed(&r, __func__);
  jfile j;
  jfile_make(&j, f->path);
  size_t n;
  unsigned char *b = read_all(f->path, &n);
  char bad[400];
  snprintf(bad, sizeof bad, "%s/bad.kvi", f->dir);
  int corrupt = 0, dropped = 0;
  for (size_t i = 0; i < n; i++) {
    const unsigned char bit = (unsigned char)(1u << rng_range(&r, 0, 7));
    b[i] ^= bit;
    write_all_file(bad, b, n);
    b[i] ^= bit;
    kvi_store *s = NULL;
    const kvi_status st = load(&s, &j.g, j.m, bad, 0);
    if (i >= j.size[j.nops - 1]) {
      if (st != KVI_OK) fail_msg("bit 0x%x of byte %zu (last entry): status %d: %s", bit, i, (int)st, kvi_last_error());
      const char *d = state_differs(s, &j.g, &j.state[j.nops - 1]);
      if (d) fail_msg("bit 0x%x of byte %zu: %s", bit, i, d);
      kvi_store_destroy(s);
      dropped++;
    } else {
      if (st != KVI_ERR_CORRUPT)
        fail_msg("bit 0x%x of byte %zu of %zu: status %d (%s), expected corrupt", bit, i, n, (int)st, kvi_last_error());
      assert_null(s);
      corrupt++;
    }
  }
  print_message("    %d flips refused as corrupt, %d in the last entry dropped as torn\n", corrupt, dropped);
  free(b);
  kvi_model_destroy(j.m);
}

/* Structural lies with valid checksums (a hostile writer): refused. */
static void put32le(unsigned char *p, uint32_t v) {
  p[0] = (unsigned char)v, p[1] = (unsigned char)(v >> 8), p[2] = (unsigned char)(v >> 16), p[3] = (unsigned char)(v >> 24);
}
static void put64le(unsigned char *p, uint64_t v) {
  put32le(p, (uint32_t)v);
  put32le(p + 4, (uint32_t)(v >> 32));
}
/* Recomputes an entry's checksums after an edit. */
static void reseal(unsigned char *b, const pentry *e) {
  put32le(b + e->off + 40, ref_crc32c(0, b + e->off + 48, (size_t)rd64(b + e->off + 24)));
  put32le(b + e->off + 44, ref_crc32c(0, b + e->off, 44));
}

static void test_hostile_records(void **state) {
  fx *f = *state;
  jfile j;
  jfile_make(&j, f->path);
  size_t n;
  unsigned char *orig = read_all(f->path, &n);
  pentry pe[16];
  const int ne = parse_file(orig, n, &j.g, pe, 16);
  assert_int_equal(ne, 3 + 1 + j.nops);
  char bad[400];
  snprintf(bad, sizeof bad, "%s/hostile.kvi", f->dir);
  unsigned char *b = malloc(n + 64);
  struct {
    int entry;       /* which entry to edit */
    int off;         /* byte offset inside the entry (48 = first record) */
    int width;       /* 4 or 8 */
    uint64_t value;
    const char *needle;
  } lies[] = {
      {0, 48 + 4, 4, 0x7fffffff, "tokens"},                  /* tokens the payload does not hold */
      {0, 48 + 4, 4, 0, "0 tokens"},
      {0, 48 + 24, 8, UINT64_MAX, "payload"},                 /* a payload past everything */
      {0, 48, 4, 9, "unknown record type 9"},
      {0, 48, 4, 2, "removal record with"},                   /* a removal with data */
      {0, 32, 4, 4, "records in a"},                          /* more records than the entry can hold */
      {0, 32, 4, 0, "0 records"},
      {0, 16, 8, 5, "entry number 5"},
      {0, 4, 4, 7, "unknown entry kind 7"},
      {3, 48, 8, 4, "end entry counts 4 facts"},              /* END lies about the count */
      {4, 48 + 16, 8, 987654321, "not stored"},              /* removal of an absent fact: first log entry is a put; edit below */
  };
  for (size_t i = 0; i < sizeof lies / sizeof lies[0]; i++) {
    memcpy(b, orig, n);
    const pentry *e = &pe[lies[i].entry];
    if (i == sizeof lies / sizeof lies[0] - 1) {
      /* turn log entry 6 (the removal of slot 0) into the removal of an unknown id */
      e = &pe[6];
      assert_int_equal(rd32(b + e->off + 48), 2);
    }
    unsigned char *p = b + e->off + lies[i].off;
    if (lies[i].width == 4) put32le(p, (uint32_t)lies[i].value);
    else put64le(p, lies[i].value);
    if (lies[i].off >= 48) put32le(b + e->off + 40, ref_crc32c(0, b + e->off + 48, (size_t)e->body));
    put32le(b + e->off + 44, ref_crc32c(0, b + e->off, 44));
    write_all_file(bad, b, n);
    kvi_store *s = NULL;
    const kvi_status st = load(&s, &j.g, j.m, bad, 0);
    if (st != KVI_ERR_CORRUPT) fail_msg("lie %zu: status %d (%s), expected corrupt", i, (int)st, kvi_last_error());
    assert_last_error_has("kvi_store_load", lies[i].needle);
    assert_null(s);
  }
  /* a key twice in the snapshot: entry 1 given entry 0's tenant and id */
  memcpy(b, orig, n);
  memcpy(b + pe[1].off + 48 + 8, b + pe[0].off + 48 + 8, 16);
  reseal(b, &pe[1]);
  write_all_file(bad, b, n);
  kvi_store *s = NULL;
  assert_status(load(&s, &j.g, j.m, bad, 0), KVI_ERR_CORRUPT);
  assert_last_error_has("kvi_store_load", "twice in the snapshot");
  /* a non-finite embedding, with valid checksums */
  memcpy(b, orig, n);
  put32le(b + pe[0].off + 48 + 32, 0x7fc00000u);
  reseal(b, &pe[0]);
  write_all_file(bad, b, n);
  assert_status(load(&s, &j.g, j.m, bad, 0), KVI_ERR_CORRUPT);
  assert_last_error_has("kvi_store_load", "embedding[0]");
  /* non-zero padding */
  memcpy(b, orig, n);
  const uint64_t payload = rd64(b + pe[0].off + 48 + 24);
  assert_true(payload % 8 != 0);
  b[pe[0].off + 48 + 32 + payload] = 1;
  reseal(b, &pe[0]);
  write_all_file(bad, b, n);
  assert_status(load(&s, &j.g, j.m, bad, 0), KVI_ERR_CORRUPT);
  assert_last_error_has("kvi_store_load", "padding");
  /* a header that claims a huge size, and a version from the future */
  memcpy(b, orig, n);
  put32le(b + 16, 0xfffffff0u);
  write_all_file(bad, b, n);
  assert_status(load(&s, &j.g, j.m, bad, 0), KVI_ERR_CORRUPT);
  assert_last_error_has("kvi_store_load", "header size");
  memcpy(b, orig, n);
  put32le(b + 8, 5);
  const uint32_t hb = rd32(b + 16);
  put32le(b + hb - 4, ref_crc32c(0, b, hb - 4));
  write_all_file(bad, b, n);
  assert_status(load(&s, &j.g, j.m, bad, 0), KVI_ERR_INCOMPATIBLE);
  assert_last_error_has("kvi_store_load", "format version 5");
  /* trailing garbage after the end of the snapshot is a torn tail (no valid entry follows) */
  memcpy(b, orig, pe[4].off);
  memset(b + pe[4].off, 0, 40);
  write_all_file(bad, b, pe[4].off + 40);
  assert_ok(load(&s, &j.g, j.m, bad, 0));
  assert_state(s, &j.g, &j.state[0]);
  kvi_store_destroy(s);
  /* an entry of another file in the log */
  memcpy(b, orig, n);
  put64le(b + pe[5].off + 8, 42);
  reseal(b, &pe[5]);
  write_all_file(bad, b, n);
  assert_status(load(&s, &j.g, j.m, bad, 0), KVI_ERR_CORRUPT);
  assert_last_error_has("kvi_store_load", "another file");
  free(b);
  free(orig);
  kvi_model_destroy(j.m);
}

/* ------------------------------------------------------------------------ */
/* the journal                                                              */
/* ------------------------------------------------------------------------ */

static void test_journal_roundtrip(void **state) {
  fx *f = *state;
  rng r;
  rng_seed(&r, __func__);
  geo g = small_geo();
  kvi_model *m = geo_model(&g);
  kvi_store *s = geo_store(&g, m);
  rstate ref;
  memset(&ref, 0, sizeof ref);
  assert_status(kvi_store_journal_open(NULL, f->path, 0), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_store_journal_open(s, NULL, 0), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_store_journal_open(s, "", 0), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_store_journal_open(s, f->path, 1), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_store_journal_close(NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_ok(kvi_store_journal_close(s)); /* none open: a no-op */
  assert_ok(put_tag(s, &g, slot_tenant(0), slot_id(0), 6, 1, 0));
  ref.present[0] = true, ref.tokens[0] = 6, ref.tag[0] = 1;
  assert_ok(kvi_store_journal_open(s, f->path, 0));
  const uint64_t snap = file_size(f->path);
  for (int round = 0; round < 3; round++) {
    for (int op = 0; op < 25; op++) {
      const int sl = (int)rng_range(&r, 0, NSLOT - 1);
      if (ref.present[sl] && rng_range(&r, 0, 2) == 0) {
        assert_ok(kvi_store_remove(s, slot_tenant(sl), slot_id(sl)));
        ref.present[sl] = false;
      } else {
        const int32_t T = (int32_t)rng_range(&r, 1, 9);
        const uint64_t tag = rng_next(&r);
        assert_ok(put_tag(s, &g, slot_tenant(sl), slot_id(sl), T, tag, ref.present[sl] ? KVI_PUT_REPLACE : 0));
        ref.present[sl] = true, ref.tokens[sl] = T, ref.tag[sl] = tag;
      }
      /* failed calls write nothing */
      const uint64_t before = file_size(f->path);
      assert_status(kvi_store_remove(s, 999, 999), KVI_ERR_NOT_FOUND);
      if (ref.present[sl]) assert_status(put_tag(s, &g, slot_tenant(sl), slot_id(sl), 2, 3, 0), KVI_ERR_EXISTS);
      assert_int_equal(file_size(f->path), before);
    }
    /* what is acknowledged is in the file, at any moment */
    assert_file_state(&g, m, f->path, &ref);
    if (round == 0) {
      /* compaction: the same path rewritten as a snapshot */
      const uint64_t grown = file_size(f->path);
      assert_ok(kvi_store_journal_open(s, f->path, 0));
      assert_true(file_size(f->path) < grown);
      assert_file_state(&g, m, f->path, &ref);
    } else if (round == 1) {
      /* reopen through a load that keeps the journal */
      kvi_store_destroy(s);
      s = NULL;
      assert_ok(load(&s, &g, m, f->path, KVI_LOAD_JOURNAL));
      assert_state(s, &g, &ref);
    }
  }
  assert_true(file_size(f->path) > snap);
  /* switching to another file leaves the first one as it was */
  char other[400];
  snprintf(other, sizeof other, "%s/other.kvi", f->dir);
  assert_ok(kvi_store_journal_open(s, other, 0));
  const rstate frozen = ref;
  assert_ok(put_tag(s, &g, slot_tenant(1), slot_id(1), 2, 55, ref.present[1] ? KVI_PUT_REPLACE : 0));
  ref.present[1] = true, ref.tokens[1] = 2, ref.tag[1] = 55;
  assert_file_state(&g, m, f->path, &frozen);
  assert_file_state(&g, m, other, &ref);
  /* after close nothing more is written */
  assert_ok(kvi_store_journal_close(s));
  const uint64_t closed = file_size(other);
  assert_ok(put_tag(s, &g, slot_tenant(3), slot_id(3), 2, 56, ref.present[3] ? KVI_PUT_REPLACE : 0));
  assert_int_equal(file_size(other), closed);
  kvi_store_destroy(s);
  kvi_model_destroy(m);
}

/* KVI_LOAD_JOURNAL cuts a torn final entry off before appending. */
static void test_load_journal_cuts_torn_tail(void **state) {
  fx *f = *state;
  jfile j;
  jfile_make(&j, f->path);
  /* cut the last entry in half */
  const uint64_t cut = (j.size[j.nops - 1] + j.size[j.nops]) / 2;
  assert_int_equal(truncate(f->path, (off_t)cut), 0);
  kvi_store *s = NULL;
  assert_ok(load(&s, &j.g, j.m, f->path, KVI_LOAD_JOURNAL));
  assert_state(s, &j.g, &j.state[j.nops - 1]);
  assert_int_equal(file_size(f->path), j.size[j.nops - 1]);
  rstate r = j.state[j.nops - 1];
  assert_ok(put_tag(s, &j.g, slot_tenant(7), slot_id(7), 3, 77, 0));
  r.present[7] = true, r.tokens[7] = 3, r.tag[7] = 77;
  kvi_store_destroy(s);
  assert_file_state(&j.g, j.m, f->path, &r);
  size_t n;
  unsigned char *b = read_all(f->path, &n);
  pentry pe[16];
  assert_int_equal(parse_file(b, n, &j.g, pe, 16), 3 + 1 + j.nops);
  free(b);
  kvi_model_destroy(j.m);
}

/* A write that fails (the file may not grow) fails the call and changes
 * nothing; the journal keeps working once writes succeed again. */
static void test_journal_write_failure(void **state) {
  fx *f = *state;
  geo g = small_geo();
  kvi_model *m = geo_model(&g);
  kvi_store *s = geo_store(&g, m);
  rstate ref;
  memset(&ref, 0, sizeof ref);
  assert_ok(put_tag(s, &g, slot_tenant(0), slot_id(0), 4, 1, 0));
  ref.present[0] = true, ref.tokens[0] = 4, ref.tag[0] = 1;
  assert_ok(kvi_store_journal_open(s, f->path, 0));
  const uint64_t size = file_size(f->path);
  struct rlimit old, lim;
  assert_int_equal(getrlimit(RLIMIT_FSIZE, &old), 0);
  void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
  lim = old;
  lim.rlim_cur = size + 100; /* room for a removal (80 bytes), not for a fact */
  assert_int_equal(setrlimit(RLIMIT_FSIZE, &lim), 0);
  const kvi_status put_new = put_tag(s, &g, slot_tenant(1), slot_id(1), 4, 2, 0);
  const kvi_status put_rep = put_tag(s, &g, slot_tenant(0), slot_id(0), 7, 3, KVI_PUT_REPLACE);
  const uint64_t size_after = file_size(f->path);
  lim.rlim_cur = size + 50; /* not even a removal */
  assert_int_equal(setrlimit(RLIMIT_FSIZE, &lim), 0);
  const kvi_status rem = kvi_store_remove(s, slot_tenant(0), slot_id(0));
  assert_int_equal(setrlimit(RLIMIT_FSIZE, &old), 0);
  signal(SIGXFSZ, prev);
  assert_status(put_new, KVI_ERR_IO);
  assert_status(put_rep, KVI_ERR_IO);
  assert_status(rem, KVI_ERR_IO);
  assert_last_error_has("kvi_store_remove", "appending");
  assert_int_equal(size_after, size); /* the partial entries were taken back */
  assert_int_equal(file_size(f->path), size);
  assert_state(s, &g, &ref); /* nothing changed */
  assert_ok(put_tag(s, &g, slot_tenant(1), slot_id(1), 4, 2, 0));
  ref.present[1] = true, ref.tokens[1] = 4, ref.tag[1] = 2;
  assert_ok(kvi_store_remove(s, slot_tenant(0), slot_id(0)));
  ref.present[0] = false;
  assert_state(s, &g, &ref);
  assert_file_state(&g, m, f->path, &ref);
  kvi_store_destroy(s);
  kvi_model_destroy(m);
}

/* A journal file is locked: no other store may write it. */
static void test_journal_locks(void **state) {
  fx *f = *state;
  geo g = small_geo();
  kvi_model *m = geo_model(&g);
  kvi_store *a = geo_store(&g, m), *b = geo_store(&g, m), *l = NULL;
  rstate ref;
  memset(&ref, 0, sizeof ref);
  assert_ok(put_tag(a, &g, slot_tenant(0), slot_id(0), 4, 1, 0));
  ref.present[0] = true, ref.tokens[0] = 4, ref.tag[0] = 1;
  assert_ok(kvi_store_journal_open(a, f->path, 0));
  assert_status(kvi_store_journal_open(b, f->path, 0), KVI_ERR_IO);
  assert_last_error_has("kvi_store_journal_open", "is the journal of an open store");
  assert_status(kvi_store_save(b, f->path, NULL), KVI_ERR_IO);
  assert_status(kvi_store_save(a, f->path, NULL), KVI_ERR_IO); /* its own journal too: it would be orphaned */
  assert_status(load(&l, &g, m, f->path, KVI_LOAD_JOURNAL), KVI_ERR_IO);
  assert_last_error_has("kvi_store_load", "is the journal of an open store");
  assert_null(l);
  assert_int_equal(dir_count(f->dir, "facts.kvi.tmp"), 0);
  assert_file_state(&g, m, f->path, &ref); /* reading is allowed */
  assert_ok(kvi_store_journal_open(a, f->path, 0)); /* compaction by its owner */
  assert_ok(kvi_store_journal_close(a));
  assert_ok(kvi_store_journal_open(b, f->path, 0)); /* free again */
  memset(&ref, 0, sizeof ref);
  assert_file_state(&g, m, f->path, &ref);
  kvi_store_destroy(a);
  kvi_store_destroy(b);
  kvi_model_destroy(m);
}

/* kvi_encode's captures go to the journal as one all-or-nothing entry. */
static void test_journal_encode(void **state) {
  fx *f = *state;
  geo g = small_geo();
  g.dt = KVI_DTYPE_FP32;
  kvi_model *m = geo_model(&g);
  kvi_store *s = geo_store(&g, m);
  /* a TensorRT-LLM pool [NB, L, 2, H, BS, D] in fp32 with random contents */
  const int32_t BS = 4, NB = 8;
  const size_t elems = (size_t)NB * g.L * 2 * g.H * BS * g.D;
  float *pool = malloc(elems * sizeof *pool);
  rng r;
  rng_seed(&r, __func__);
  for (size_t i = 0; i < elems; i++) pool[i] = rand_float(&r);
  kvi_cache_layout cl;
  assert_ok(kvi_cache_layout_preset(&cl, KVI_CACHE_TRTLLM, KVI_DTYPE_FP32, g.L, g.H, g.D, BS, NB, NULL, NULL, pool));
  cl.memory = KVI_MEMORY_HOST;
  kvi_encoder *enc = NULL;
  assert_ok(kvi_encoder_create(&enc, s, &cl, NULL));
  assert_ok(put_tag(s, &g, 5, 1, 3, 9, 0));
  assert_ok(kvi_store_journal_open(s, f->path, 0));
  const uint64_t before = file_size(f->path);
  const int32_t table[] = {3, 1, 6, 0};
  float emb[3][3];
  kvi_capture caps[3];
  for (int i = 0; i < 3; i++) {
    kvi_capture_init(&caps[i], sizeof caps[i]);
    caps[i].tenant = 5;
    caps[i].fact_id = 10 + (uint64_t)i;
    caps[i].block_table = table;
    caps[i].block_table_len = 4;
    caps[i].first_slot = 3 * i + 1;
    caps[i].num_tokens = 2 + i;
    caps[i].start_position = 17 * i;
    for (int k = 0; k < 3; k++) emb[i][k] = (float)(i * 3 + k);
    caps[i].embedding = emb[i];
  }
  caps[0].fact_id = 1; /* replaces the put fact */
  caps[0].flags = KVI_PUT_REPLACE;
  assert_ok(kvi_encode(enc, caps, 3, NULL));
  const uint64_t after = file_size(f->path);
  size_t n;
  unsigned char *b = read_all(f->path, &n);
  pentry pe[8];
  const int ne = parse_file(b, n, &g, pe, 8);
  assert_int_equal(ne, 3); /* snapshot fact, END, one log entry */
  assert_int_equal(pe[2].count, 3);
  assert_int_equal(pe[2].off, before);
  free(b);
  /* the reloaded facts are the live store's, bit for bit */
  kvi_store *l = NULL;
  assert_ok(load(&l, &g, m, f->path, 0));
  for (int i = 0; i < 3; i++) {
    const int32_t T = 2 + i;
    const size_t fe = (size_t)fact_elems(&g, T);
    float *x = malloc(fe * sizeof *x), *y = malloc(fe * sizeof *y);
    kvi_kv_view vx, vy;
    kvi_kv_view_contiguous(&vx, KVI_MEMORY_HOST, KVI_DTYPE_FP32, g.L, T, g.H, g.D, x, x + fe / 2);
    kvi_kv_view_contiguous(&vy, KVI_MEMORY_HOST, KVI_DTYPE_FP32, g.L, T, g.H, g.D, y, y + fe / 2);
    assert_ok(kvi_store_read(s, 5, caps[i].fact_id, &vx, NULL));
    assert_ok(kvi_store_read(l, 5, caps[i].fact_id, &vy, NULL));
    assert_memory_equal(x, y, fe * sizeof *x);
    float e2[3];
    assert_ok(kvi_store_get_embedding(l, 5, caps[i].fact_id, e2));
    assert_memory_equal(e2, emb[i], sizeof e2);
    free(x);
    free(y);
  }
  size_t count = 0;
  assert_ok(kvi_store_count(l, 5, &count));
  assert_int_equal(count, 3);
  kvi_store_destroy(l);
  /* the group is all or nothing: cut anywhere inside it, none of it loads */
  char cut[400];
  snprintf(cut, sizeof cut, "%s/cut.kvi", f->dir);
  b = read_all(f->path, &n);
  for (uint64_t len = before; len < after; len += 7) {
    write_all_file(cut, b, (size_t)len);
    assert_ok(load(&l, &g, m, cut, 0));
    assert_ok(kvi_store_count(l, 5, &count));
    assert_int_equal(count, 1);
    assert_null(fact_differs(l, &g, 5, 1, 3, 9));
    kvi_store_destroy(l);
  }
  free(b);
  kvi_encoder_destroy(enc);
  kvi_store_destroy(s);
  kvi_model_destroy(m);
  free(pool);
}

/* Several threads change the store while another compacts the journal:
 * the file always ends equal to the store. */
typedef struct cthread {
  kvi_store *s;
  const geo *g;
  int tenant;
  uint64_t seed;
  int ops;
  kvi_status err;
  char msg[256];
} cthread;

static void *changer(void *arg) {
  cthread *c = arg;
  rng r = {c->seed};
  bool present[8] = {false};
  for (int i = 0; i < c->ops && c->err == KVI_OK; i++) {
    const int k = (int)(rng_next(&r) % 8);
    kvi_status st;
    if (present[k] && rng_next(&r) % 3 == 0) {
      st = kvi_store_remove(c->s, (uint64_t)c->tenant, (uint64_t)k);
      present[k] = false;
    } else {
      st = put_tag(c->s, c->g, (uint64_t)c->tenant, (uint64_t)k, 1 + (int32_t)(rng_next(&r) % 6), rng_next(&r),
                   present[k] ? KVI_PUT_REPLACE : 0);
      present[k] = true;
    }
    if (st) {
      c->err = st;
      snprintf(c->msg, sizeof c->msg, "%s", kvi_last_error());
    }
  }
  return NULL;
}

static void test_journal_concurrent(void **state) {
  fx *f = *state;
  rng r;
  rng_seed(&r, __func__);
  geo g = small_geo();
  g.budget = 2u << 20;
  kvi_model *m = geo_model(&g);
  kvi_store *s = geo_store(&g, m);
  assert_ok(kvi_store_journal_open(s, f->path, 0));
  cthread c[4];
  pthread_t th[4];
  for (int i = 0; i < 4; i++) {
    c[i] = (cthread){s, &g, i + 1, rng_next(&r), 60, KVI_OK, ""};
    assert_int_equal(pthread_create(&th[i], NULL, changer, &c[i]), 0);
  }
  int compactions = 0;
  for (int i = 0; i < 8; i++) {
    assert_ok(kvi_store_journal_open(s, f->path, 0));
    compactions++;
    usleep(2000);
  }
  for (int i = 0; i < 4; i++) {
    assert_int_equal(pthread_join(th[i], NULL), 0);
    if (c[i].err) fail_msg("thread %d: status %d: %s", i, (int)c[i].err, c[i].msg);
  }
  kvi_store *l = NULL;
  assert_ok(load(&l, &g, m, f->path, 0));
  for (uint64_t t = 1; t <= 4; t++) {
    uint64_t ia[8], ib[8];
    size_t na = 0, nb = 0;
    assert_ok(kvi_store_list(s, t, ia, 8, &na));
    assert_ok(kvi_store_list(l, t, ib, 8, &nb));
    assert_int_equal(na, nb);
    assert_memory_equal(ia, ib, na * sizeof *ia);
    for (size_t i = 0; i < na; i++) {
      int32_t T;
      assert_ok(kvi_store_fact_tokens(s, t, ia[i], &T));
      const size_t fe = (size_t)fact_elems(&g, T) * 2;
      unsigned char *x = malloc(fe), *y = malloc(fe);
      kvi_kv_view vx, vy;
      kvi_kv_view_contiguous(&vx, KVI_MEMORY_HOST, g.dt, g.L, T, g.H, g.D, x, x + fe / 2);
      kvi_kv_view_contiguous(&vy, KVI_MEMORY_HOST, g.dt, g.L, T, g.H, g.D, y, y + fe / 2);
      assert_ok(kvi_store_read(s, t, ia[i], &vx, NULL));
      assert_ok(kvi_store_read(l, t, ia[i], &vy, NULL));
      assert_memory_equal(x, y, fe);
      free(x);
      free(y);
    }
  }
  print_message("    4 threads x 60 changes, %d compactions\n", compactions);
  kvi_store_destroy(l);
  kvi_store_destroy(s);
  kvi_model_destroy(m);
}

/* ------------------------------------------------------------------------ */
/* crashes: SIGKILL a child at random moments                               */
/* ------------------------------------------------------------------------ */

typedef struct cop {
  int kind; /* 0 put, 1 remove, 2 compact (journal_open again) / save */
  int slot;
  int32_t tokens;
  uint64_t tag;
} cop;

#define CRASH_OPS 400

/* Ops for one child, generated from the state it starts in. */
static void gen_ops(rng *r, const rstate *start, cop *ops, int n, bool compactions) {
  rstate st = *start;
  for (int i = 0; i < n; i++) {
    cop *o = &ops[i];
    o->slot = (int)rng_range(r, 0, NSLOT - 1);
    if (compactions && rng_range(r, 0, 9) == 0) {
      o->kind = 2;
    } else if (st.present[o->slot] && rng_range(r, 0, 2) == 0) {
      o->kind = 1;
      st.present[o->slot] = false;
    } else {
      o->kind = 0;
      o->tokens = (int32_t)rng_range(r, 1, 9);
      o->tag = rng_next(r);
      st.present[o->slot] = true;
    }
  }
}

static void apply_op(rstate *st, const cop *o) {
  if (o->kind == 0) st->present[o->slot] = true, st->tokens[o->slot] = o->tokens, st->tag[o->slot] = o->tag;
  else if (o->kind == 1) st->present[o->slot] = false;
}

static void child_fail(int fd, const char *what) {
  char msg[300];
  snprintf(msg, sizeof msg, "%s: %s", what, kvi_last_error());
  const int32_t code = -1;
  if (write(fd, &code, 4) == 4 && write(fd, msg, sizeof msg) > 0) {
  }
  for (;;) pause();
}

/* The child: opens the file (or starts it), runs the ops, reports each
 * acknowledged one on `fd`, then waits to be killed. journal: changes go
 * through the journal; else each op is followed by a save. */
static void child_main(const geo *g, const kvi_model *m, const char *path, const cop *ops, int n, bool journal,
                       bool exists, int fd) {
  kvi_store *s = NULL;
  if (exists) {
    if (load(&s, g, m, path, journal ? KVI_LOAD_JOURNAL : 0) != KVI_OK) child_fail(fd, "load");
  } else {
    kvi_store_options o = geo_opts(g);
    if (kvi_store_create(&s, m, &o) != KVI_OK) child_fail(fd, "create");
    if (journal && kvi_store_journal_open(s, path, 0) != KVI_OK) child_fail(fd, "journal_open");
  }
  for (int32_t i = 0; i < n; i++) {
    const cop *o = &ops[i];
    kvi_status st = KVI_OK;
    if (o->kind == 0) {
      int32_t t;
      const bool present = kvi_store_fact_tokens(s, slot_tenant(o->slot), slot_id(o->slot), &t) == KVI_OK;
      st = put_tag(s, g, slot_tenant(o->slot), slot_id(o->slot), o->tokens, o->tag, present ? KVI_PUT_REPLACE : 0);
    } else if (o->kind == 1) {
      st = kvi_store_remove(s, slot_tenant(o->slot), slot_id(o->slot));
    } else if (journal) {
      st = kvi_store_journal_open(s, path, 0);
    }
    if (st == KVI_OK && !journal) st = kvi_store_save(s, path, NULL);
    if (st) child_fail(fd, "op");
    if (write(fd, &i, 4) != 4) _exit(4);
  }
  const int32_t done = -2;
  if (write(fd, &done, 4) != 4) _exit(4);
  for (;;) pause();
}

static void crash_test(fx *f, bool journal, const char *name) {
  rng r;
  rng_seed(&r, name);
  geo g = small_geo();
  g.budget = 1u << 20;
  kvi_model *m = geo_model(&g);
  rstate cur;
  memset(&cur, 0, sizeof cur);
  cop *ops = malloc(CRASH_OPS * sizeof *ops);
  const int iterations = 120;
  const double budget = 6.0, t0 = now_s();
  int it, acked_total = 0, in_flight_done = 0, finished = 0;
  bool exists = false;
  for (it = 0; it < iterations && (it < 25 || now_s() - t0 < budget); it++) {
    gen_ops(&r, &cur, ops, CRASH_OPS, journal);
    int pfd[2];
    assert_int_equal(pipe(pfd), 0);
    fflush(stdout);
    fflush(stderr);
    const pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
      close(pfd[0]);
      child_main(&g, m, f->path, ops, CRASH_OPS, journal, exists, pfd[1]);
      _exit(5);
    }
    close(pfd[1]);
    /* kill at a random moment: mostly while it works, sometimes at once */
    const long us = rng_range(&r, 0, 3) == 0 ? (long)rng_range(&r, 0, 2000) : (long)rng_range(&r, 2000, 40000);
    usleep((useconds_t)us);
    kill(pid, SIGKILL);
    int wst;
    assert_int_equal(waitpid(pid, &wst, 0), pid);
    /* what the child acknowledged */
    int acked = 0;
    int32_t v;
    bool done = false;
    while (read(pfd[0], &v, 4) == 4) {
      if (v == -1) {
        char msg[300] = "";
        if (read(pfd[0], msg, sizeof msg) <= 0) msg[0] = '\0';
        fail_msg("iteration %d: the child failed: %s", it, msg);
      }
      if (v == -2) {
        done = true;
        continue;
      }
      assert_int_equal(v, acked);
      acked++;
    }
    close(pfd[0]);
    finished += done;
    struct stat sb;
    if (stat(f->path, &sb) != 0) {
      /* killed before the first file existed: nothing was acknowledged */
      assert_int_equal(acked, 0);
      continue;
    }
    exists = true;
    /* the file holds the acknowledged changes, or those and the one in flight */
    rstate st_a = cur;
    for (int i = 0; i < acked; i++) apply_op(&st_a, &ops[i]);
    kvi_store *l = NULL;
    const kvi_status ls = load(&l, &g, m, f->path, 0);
    if (ls) fail_msg("iteration %d (%d acknowledged): load: %d: %s", it, acked, (int)ls, kvi_last_error());
    const char *d = state_differs(l, &g, &st_a);
    if (d && acked < CRASH_OPS) {
      char first[320];
      snprintf(first, sizeof first, "%s", d);
      rstate st_b = st_a;
      apply_op(&st_b, &ops[acked]);
      d = state_differs(l, &g, &st_b);
      if (d)
        fail_msg("iteration %d: the file holds neither the %d acknowledged changes (%s) nor one more (%s)", it, acked,
                 first, d);
      st_a = st_b;
      in_flight_done++;
    } else if (d) {
      fail_msg("iteration %d: %s", it, d);
    }
    kvi_store_destroy(l);
    cur = st_a;
    acked_total += acked;
  }
  print_message("    %d kills, %d acknowledged %s checked, %d kills after the change in flight was written, "
                "%d children finished, %d temporary files left by kills\n",
                it, acked_total, journal ? "changes" : "saves", in_flight_done, finished,
                dir_count(f->dir, "facts.kvi.tmp"));
  assert_true(acked_total > 0);
  free(ops);
  kvi_model_destroy(m);
}

static void test_crash_journal(void **state) { crash_test(*state, true, __func__); }
static void test_crash_save(void **state) { crash_test(*state, false, __func__); }

/* Embeddings kept as bf16 with the cosine metric come back bit for bit (a
 * load must not scale them a second time), and a load asking for another
 * embedding dtype or metric is refused. */
static void test_embedding_dtype_metric(void **state) {
  fx *f = *state;
  geo g = small_geo();
  g.E = 16; /* long enough that scaling a rounded unit vector again moves some bf16 values */
  kvi_model *m = geo_model(&g);
  kvi_store_options o = geo_opts(&g);
  o.embedding_dtype = KVI_DTYPE_BF16;
  o.metric = KVI_METRIC_COSINE;
  kvi_store *s = NULL;
  assert_ok(kvi_store_create(&s, m, &o));
  for (uint64_t id = 1; id <= 40; id++) assert_ok(put_tag(s, &g, 7, id, 1 + (int32_t)(id % 5), 0x100 + id, 0));
  assert_ok(kvi_store_save(s, f->path, NULL));
  kvi_store *t = NULL;
  assert_ok(kvi_store_load(&t, m, &o, f->path, NULL));
  for (uint64_t id = 1; id <= 40; id++) {
    float a[16], b[16];
    assert_ok(kvi_store_get_embedding(s, 7, id, a));
    assert_ok(kvi_store_get_embedding(t, 7, id, b));
    assert_memory_equal(a, b, (size_t)g.E * sizeof(float));
    double n2 = 0;
    for (int i = 0; i < g.E; i++) n2 += (double)a[i] * a[i];
    assert_true(fabs(n2 - 1.0) < 2e-2); /* unit length, to bf16 rounding */
  }
  kvi_store_destroy(t);
  t = NULL;
  kvi_store_options o2 = o;
  o2.metric = KVI_METRIC_INNER_PRODUCT;
  assert_int_equal(kvi_store_load(&t, m, &o2, f->path, NULL), KVI_ERR_INCOMPATIBLE);
  assert_null(t);
  o2 = o;
  o2.embedding_dtype = KVI_DTYPE_FP16;
  assert_int_equal(kvi_store_load(&t, m, &o2, f->path, NULL), KVI_ERR_INCOMPATIBLE);
  assert_null(t);
  kvi_store_destroy(s);
  kvi_model_destroy(m);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_crc32c_reference),
      cmocka_unit_test_setup_teardown(test_roundtrip, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_record_payload_bytes, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_save_one_tenant_and_empty, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_incompatible, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_embedding_dtype_metric, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_load_errors, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_save_errors, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_truncated_everywhere, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_bit_flips_everywhere, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_hostile_records, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_journal_roundtrip, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_load_journal_cuts_torn_tail, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_journal_write_failure, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_journal_locks, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_journal_encode, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_journal_concurrent, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_crash_journal, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_crash_save, fx_setup, fx_teardown),
  };
  return cmocka_run_group_tests_name("unit-persist", tests, NULL, NULL);
}
