/*
 * The disk tier (kvinject/store.h, "Disk tier"): tier moves both ways with
 * byte-exact round trips (bf16, fp8, 4-bit against a memory-only store of
 * the same dtype), a tiny memory budget with many facts, injection from
 * facts on disk, kills during writes and prefetches (fork + SIGKILL), torn
 * and damaged tenant files, two replicas sharing a directory (leases), a
 * directory that cannot be written, a full disk (the byte budget, a file
 * size limit), tenant isolation and compaction.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "unit_disk.h"

enum { L = 2, H = 2, D = 8, P = 4 };

typedef disk_fx fx;

static int fx_setup(void **state) {
  *state = disk_fx_new("disk", L, H, D);
  return *state ? 0 : -1;
}

static int fx_teardown(void **state) {
  disk_fx_free(*state);
  return 0;
}

static uint64_t page_bytes(kvi_dtype dt) {
  kvi_store_options o = cpu_store_options(dt, P, 1u << 20);
  kvi_store *s = NULL;
  kvi_model *m = make_model(L, H, D, 0, 1);
  assert_ok(kvi_store_create(&s, m, &o));
  const uint64_t pb = store_stats(s).page_bytes;
  kvi_store_destroy(s);
  kvi_model_destroy(m);
  return pb;
}

/* A CPU store with `pages` pages of memory; dir: its disk tier (NULL: none). */
static kvi_store *mk_store(const fx *f, kvi_dtype dt, uint64_t pages, const char *dir, const char *owner,
                           int32_t lease_ms, uint64_t disk_budget) {
  kvi_store_options o = cpu_store_options(dt, P, pages * page_bytes(dt));
  o.disk_dir = dir;
  o.disk_owner = owner;
  o.disk_lease_ms = lease_ms;
  o.disk_budget_bytes = disk_budget;
  kvi_store *s = NULL;
  assert_ok(kvi_store_create(&s, f->m, &o));
  return s;
}

static int32_t tokens_of(uint64_t tag) { return 1 + (int32_t)(tag % 9); } /* 1..9 tokens: 1..3 pages */

static kvi_status put_tag(kvi_store *s, uint64_t tenant, uint64_t id, uint64_t tag, uint32_t flags) {
  kvbuf b;
  kvbuf_make(&b, LAYOUT_CONTIG, KVI_DTYPE_FP32, L, tokens_of(tag), H, D);
  kvbuf_fill_tag(&b, tag * 7919u + 13u);
  kvi_put_options po = KVI_PUT_OPTIONS_INIT;
  po.flags = flags;
  const kvi_status st = kvi_store_put(s, tenant, id, &b.v, &po, NULL);
  kvbuf_free(&b);
  return st;
}

/* The fact read as fp32 (malloc'd, *n floats), or NULL when it cannot be read. */
static float *read_fact(const kvi_store *s, uint64_t tenant, uint64_t id, size_t *n) {
  int32_t T = 0;
  if (kvi_store_fact_tokens(s, tenant, id, &T) != KVI_OK) return NULL;
  *n = (size_t)2 * L * T * H * D;
  float *buf = malloc(*n * sizeof *buf);
  kvi_kv_view v;
  kvi_kv_view_contiguous(&v, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, T, H, D, buf, buf + *n / 2);
  if (kvi_store_read(s, tenant, id, &v, NULL) != KVI_OK) {
    free(buf);
    return NULL;
  }
  return buf;
}

/* Whether (tenant, id) reads back from a as it does from the reference b. */
static bool same_fact(const kvi_store *a, const kvi_store *b, uint64_t tenant, uint64_t id) {
  size_t na = 0, nb = 0;
  float *x = read_fact(a, tenant, id, &na), *y = read_fact(b, tenant, id, &nb);
  const bool ok = x && y && na == nb && memcmp(x, y, na * sizeof *x) == 0;
  if (!ok) print_error("fact %llu/%llu differs (%s)\n", (unsigned long long)tenant, (unsigned long long)id, kvi_last_error());
  free(x);
  free(y);
  return ok;
}

static int32_t tier_of(const kvi_store *s, uint64_t tenant, uint64_t id) {
  int32_t t = -1;
  assert_ok(kvi_store_fact_tier(s, tenant, id, &t));
  return t;
}

static size_t count_of(const kvi_store *s, uint64_t tenant) {
  size_t n = 0;
  assert_ok(kvi_store_count(s, tenant, &n));
  return n;
}

static void tenant_file(const fx *f, uint64_t tenant, const char *ext, char *out, size_t n) {
  snprintf(out, n, "%s/%016llx%s", f->dir, (unsigned long long)tenant, ext);
}

static off_t fsize(const char *path) {
  struct stat sb;
  return stat(path, &sb) == 0 ? sb.st_size : -1;
}

/* ------------------------------------------------------------------------ */

/* Facts move down (dropped when memory is short) and up (read back when
 * read, prefetched), bytes equal to a memory-only store's, for bf16, fp8
 * and 4-bit storage. */
static void test_tier_moves_roundtrip(void **state) {
  fx *f = *state;
  const kvi_dtype dts[3] = {KVI_DTYPE_BF16, KVI_DTYPE_FP8_E4M3, KVI_DTYPE_Q4};
  for (int k = 0; k < 3; k++) {
    char dir[600];
    snprintf(dir, sizeof dir, "%s/d%d", f->dir, k);
    assert_int_equal(mkdir(dir, 0700), 0);
    kvi_store *s = mk_store(f, dts[k], 4, dir, NULL, 0, 0), *ref = mk_store(f, dts[k], 64, NULL, NULL, 0, 0);
    for (uint64_t id = 0; id < 12; id++) {
      assert_ok(put_tag(s, 5, id, id + 100 * (uint64_t)k, 0));
      assert_ok(put_tag(ref, 5, id, id + 100 * (uint64_t)k, 0));
    }
    kvi_store_stats st = store_stats(s);
    assert_int_equal(st.facts, 12);
    assert_true(st.facts_on_disk_only > 0);
    assert_true(st.drops_to_disk >= st.facts_on_disk_only);
    assert_true(st.disk_writes >= 12);
    assert_true(st.disk_bytes > 0);
    uint64_t down = 12;
    for (uint64_t id = 0; id < 12; id++)
      if (tier_of(s, 5, id) == KVI_TIER_DISK) down = id;
    assert_true(down < 12);
    /* up: read back from disk, byte-exact; down again as others come up */
    for (int round = 0; round < 2; round++)
      for (uint64_t id = 0; id < 12; id++) {
        assert_true(same_fact(s, ref, 5, id));
        assert_int_equal(tier_of(s, 5, id), KVI_TIER_HOST);
      }
    st = store_stats(s);
    assert_true(st.disk_reads >= 12);
    assert_true(st.disk_read_bytes > 0);
    /* prefetch of the named facts brings them up, on the store's I/O thread */
    for (uint64_t id = 0; id < 12; id++) /* 0 and 1 go down */
      if (id > 1) assert_true(same_fact(s, ref, 5, id));
    assert_int_equal(tier_of(s, 5, 0), KVI_TIER_DISK);
    const uint64_t want[2] = {0, 1};
    assert_ok(kvi_store_prefetch(s, 5, want, 2, NULL));
    const double t0 = now_s();
    while ((tier_of(s, 5, 0) != KVI_TIER_HOST || tier_of(s, 5, 1) != KVI_TIER_HOST) && now_s() - t0 < 10) usleep(1000);
    assert_int_equal(tier_of(s, 5, 0), KVI_TIER_HOST);
    assert_int_equal(tier_of(s, 5, 1), KVI_TIER_HOST);
    kvi_store_destroy(s);
    /* another store on the directory: the tenant is read from its file */
    s = mk_store(f, dts[k], 4, dir, NULL, 0, 0);
    assert_int_equal(count_of(s, 5), 0);
    assert_ok(kvi_store_prefetch(s, 5, NULL, 0, NULL));
    assert_int_equal(count_of(s, 5), 12);
    size_t up = 0;
    for (uint64_t id = 0; id < 12; id++) up += tier_of(s, 5, id) == KVI_TIER_HOST;
    assert_true(up > 0 && up < 12); /* as much as fits */
    for (uint64_t id = 0; id < 12; id++) assert_true(same_fact(s, ref, 5, id));
    kvi_store_destroy(s);
    kvi_store_destroy(ref);
  }
}

/* Many facts through a memory of 3 pages: puts, replaces, removes, reads in
 * random order; everything reads back as a memory-only store has it, also
 * after the store is made again from the files. */
static void test_tiny_budget_many_facts(void **state) {
  fx *f = *state;
  rng r;
  rng_seed(&r, "tiny_budget");
  kvi_store *s = mk_store(f, KVI_DTYPE_BF16, 3, f->dir, NULL, 0, 0), *ref = mk_store(f, KVI_DTYPE_BF16, 4096, NULL, NULL, 0, 0);
  enum { N = 60 };
  for (int op = 0; op < 400; op++) {
    const uint64_t tenant = 1 + (uint64_t)rng_range(&r, 0, 2), id = (uint64_t)rng_range(&r, 0, N - 1);
    const int64_t what = rng_range(&r, 0, 9);
    int32_t T;
    const bool have = kvi_store_fact_tokens(ref, tenant, id, &T) == KVI_OK;
    if (what < 5) {
      const uint64_t tag = rng_next(&r);
      assert_status(put_tag(s, tenant, id, tag, KVI_PUT_REPLACE), KVI_OK);
      assert_ok(put_tag(ref, tenant, id, tag, KVI_PUT_REPLACE));
    } else if (what < 7 && have) {
      assert_ok(kvi_store_remove(s, tenant, id));
      assert_ok(kvi_store_remove(ref, tenant, id));
    } else if (have) {
      assert_true(same_fact(s, ref, tenant, id));
    }
  }
  for (uint64_t t = 1; t <= 3; t++) {
    assert_int_equal(count_of(s, t), count_of(ref, t));
    for (uint64_t id = 0; id < N; id++) {
      int32_t T;
      if (kvi_store_fact_tokens(ref, t, id, &T) == KVI_OK) assert_true(same_fact(s, ref, t, id));
      else assert_status(kvi_store_fact_tokens(s, t, id, &T), KVI_ERR_NOT_FOUND);
    }
  }
  assert_true(store_stats(s).drops_to_disk > 0);
  kvi_store_destroy(s);
  s = mk_store(f, KVI_DTYPE_BF16, 3, f->dir, NULL, 0, 0);
  for (uint64_t t = 1; t <= 3; t++) {
    assert_ok(kvi_store_prefetch(s, t, NULL, 0, NULL));
    assert_int_equal(count_of(s, t), count_of(ref, t));
    for (uint64_t id = 0; id < N; id++) {
      int32_t T;
      if (kvi_store_fact_tokens(ref, t, id, &T) == KVI_OK) assert_true(same_fact(s, ref, t, id));
    }
  }
  kvi_store_destroy(s);
  kvi_store_destroy(ref);
}

/* A vLLM flash-attention fp32 cache of 8 blocks of 4 slots. */
typedef struct cache {
  float mem[L][2][8][4][H][D];
  void *layers[L];
  kvi_cache_layout cl;
  kvi_injector *inj;
} cache;

static void cache_make(cache *c, kvi_store *s) {
  memset(c->mem, 0, sizeof c->mem);
  for (int l = 0; l < L; l++) c->layers[l] = c->mem[l];
  assert_ok(kvi_cache_layout_preset(&c->cl, KVI_CACHE_VLLM_FLASH_ATTN, KVI_DTYPE_FP32, L, H, D, 4, 8, c->layers, NULL,
                                    NULL));
  c->cl.memory = KVI_MEMORY_HOST;
  assert_ok(kvi_injector_create(&c->inj, s, &c->cl, NULL));
}

/* Injecting facts that are on disk writes what a memory-only store's
 * injection writes. */
static void test_inject_from_disk(void **state) {
  fx *f = *state;
  kvi_store *s = mk_store(f, KVI_DTYPE_BF16, 6, f->dir, NULL, 0, 0), *ref = mk_store(f, KVI_DTYPE_BF16, 64, NULL, NULL, 0, 0);
  for (uint64_t id = 0; id < 10; id++) {
    assert_ok(put_tag(s, 9, id, id * 3 + 1, 0));
    assert_ok(put_tag(ref, 9, id, id * 3 + 1, 0));
  }
  const uint64_t ids[3] = {0, 4, 1}; /* 0 and 1 are on disk by now */
  assert_int_equal(tier_of(s, 9, 0), KVI_TIER_DISK);
  cache *a = calloc(1, sizeof *a), *b = calloc(1, sizeof *b);
  cache_make(a, s);
  cache_make(b, ref);
  const int32_t table[8] = {3, 1, 7, 0, 2, 6, 5, 4};
  kvi_inject_request q = KVI_INJECT_REQUEST_INIT;
  q.tenant = 9;
  q.fact_ids = ids;
  q.num_facts = 3;
  q.block_table = table;
  q.block_table_len = 8;
  q.first_slot = 2;
  q.start_position = 5;
  assert_ok(kvi_inject(a->inj, &q, 1, NULL, NULL));
  assert_ok(kvi_inject(b->inj, &q, 1, NULL, NULL));
  assert_memory_equal(a->mem, b->mem, sizeof a->mem);
  float zero[L][2][8][4][H][D];
  memset(zero, 0, sizeof zero);
  assert_memory_not_equal(a->mem, zero, sizeof zero);
  kvi_injector_destroy(a->inj);
  kvi_injector_destroy(b->inj);
  free(a);
  free(b);
  kvi_store_destroy(s);
  kvi_store_destroy(ref);
}

/* A child writes facts and reports each acknowledged one on a pipe; it is
 * killed at a random moment. Every acknowledged fact is in the files, whole;
 * nothing else is there but whole facts of the child's puts. */
static void test_kill_during_write(void **state) {
  fx *f = *state;
  rng r;
  rng_seed(&r, "kill_during_write");
  kvi_store *ref = mk_store(f, KVI_DTYPE_BF16, 4096, NULL, NULL, 0, 0);
  for (uint64_t id = 0; id < 400; id++) assert_ok(put_tag(ref, 1 + id % 2, id, id + 7, 0));
  for (int round = 0; round < 4; round++) {
    int pfd[2];
    assert_int_equal(pipe(pfd), 0);
    const pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
      alarm(30);
      close(pfd[0]);
      kvi_store *c = mk_store(f, KVI_DTYPE_BF16, 3, f->dir, "child", 100, 0);
      for (uint64_t id = (uint64_t)round * 100; id < 400; id++) {
        if (put_tag(c, 1 + id % 2, id, id + 7, KVI_PUT_REPLACE) != KVI_OK) _exit(3);
        if (write(pfd[1], &id, sizeof id) != sizeof id) _exit(4);
      }
      _exit(0);
    }
    close(pfd[1]);
    usleep((useconds_t)rng_range(&r, 1000, 30000));
    kill(pid, SIGKILL);
    int wst;
    waitpid(pid, &wst, 0);
    uint64_t acked[400], id;
    size_t nacked = 0;
    while (read(pfd[0], &id, sizeof id) == sizeof id) acked[nacked++] = id;
    close(pfd[0]);
    print_message("round %d: killed after %zu acknowledged puts\n", round, nacked);
    /* another replica reads the files without the lease */
    kvi_store *s = mk_store(f, KVI_DTYPE_BF16, 3, f->dir, "parent", 100, 0);
    for (uint64_t t = 1; t <= 2; t++) assert_ok(kvi_store_prefetch(s, t, NULL, 0, NULL));
    for (size_t i = 0; i < nacked; i++) assert_true(same_fact(s, ref, 1 + acked[i] % 2, acked[i]));
    for (uint64_t t = 1; t <= 2; t++) {
      uint64_t ids[400];
      size_t n = 0;
      assert_ok(kvi_store_list(s, t, ids, 400, &n));
      for (size_t i = 0; i < n; i++) assert_true(same_fact(s, ref, t, ids[i]));
    }
    /* after the child's lease ran out, a write takes the tenant over (cuts a torn tail) */
    usleep(150 * 1000);
    assert_ok(put_tag(s, 1, 1000, 1000, KVI_PUT_REPLACE));
    assert_ok(put_tag(ref, 1, 1000, 1000, KVI_PUT_REPLACE));
    kvi_store_destroy(s);
  }
  kvi_store_destroy(ref);
}

/* A child prefetching and reading in a loop is killed: the files are as
 * they were (reads write nothing). */
static void test_kill_during_prefetch(void **state) {
  fx *f = *state;
  kvi_store *s = mk_store(f, KVI_DTYPE_BF16, 3, f->dir, "a", 0, 0), *ref = mk_store(f, KVI_DTYPE_BF16, 64, NULL, NULL, 0, 0);
  for (uint64_t id = 0; id < 20; id++) {
    assert_ok(put_tag(s, 4, id, id, 0));
    assert_ok(put_tag(ref, 4, id, id, 0));
  }
  assert_ok(kvi_store_tenant_release(s, 4));
  kvi_store_destroy(s);
  for (int round = 0; round < 3; round++) {
    const pid_t pid = fork();
    if (pid == 0) {
      alarm(30);
      for (;;) {
        kvi_store *c = mk_store(f, KVI_DTYPE_BF16, 3, f->dir, "c", 0, 0);
        if (kvi_store_prefetch(c, 4, NULL, 0, NULL) != KVI_OK) _exit(3);
        for (uint64_t id = 0; id < 20; id++) free(read_fact(c, 4, id, &(size_t){0}));
        kvi_store_destroy(c);
      }
    }
    usleep(20000);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    s = mk_store(f, KVI_DTYPE_BF16, 3, f->dir, "a", 0, 0);
    assert_ok(kvi_store_prefetch(s, 4, NULL, 0, NULL));
    assert_int_equal(count_of(s, 4), 20);
    for (uint64_t id = 0; id < 20; id++) assert_true(same_fact(s, ref, 4, id));
    assert_ok(put_tag(s, 4, 100 + (uint64_t)round, 1, 0)); /* writable: the lease is free */
    assert_ok(kvi_store_remove(s, 4, 100 + (uint64_t)round));
    kvi_store_destroy(s);
  }
  kvi_store_destroy(ref);
}

/* A tenant file cut inside its last entry loads without that entry; cut
 * anywhere earlier in the log, or damaged in the middle, it is
 * KVI_ERR_CORRUPT for that tenant alone. */
static void test_torn_and_corrupt_files(void **state) {
  fx *f = *state;
  kvi_store *s = mk_store(f, KVI_DTYPE_BF16, 64, f->dir, "a", 0, 0), *ref = mk_store(f, KVI_DTYPE_BF16, 64, NULL, NULL, 0, 0);
  char p1[600], p2[600];
  tenant_file(f, 1, ".kvi", p1, sizeof p1);
  tenant_file(f, 2, ".kvi", p2, sizeof p2);
  for (uint64_t id = 0; id < 6; id++) {
    assert_ok(put_tag(s, 1, id, id + 50, 0));
    assert_ok(put_tag(s, 2, id, id + 60, 0));
    assert_ok(put_tag(ref, 1, id, id + 50, 0));
    assert_ok(put_tag(ref, 2, id, id + 60, 0));
  }
  const off_t before_last = fsize(p1);
  assert_ok(put_tag(s, 1, 6, 53, 0)); /* 9 tokens: the largest entry */
  const off_t full = fsize(p1);
  kvi_store_destroy(s);
  assert_true(full > before_last);
  /* cut mid-record: the last put is torn, the rest loads */
  assert_int_equal(truncate(p1, before_last + (full - before_last) / 2), 0);
  s = mk_store(f, KVI_DTYPE_BF16, 64, f->dir, "a", 0, 0);
  assert_ok(kvi_store_prefetch(s, 1, NULL, 0, NULL));
  assert_int_equal(count_of(s, 1), 6);
  for (uint64_t id = 0; id < 6; id++) assert_true(same_fact(s, ref, 1, id));
  /* the next writer cuts the torn tail off and appends after it: a removal
   * entry (48 + 32 bytes), shorter than the torn bytes it replaces */
  assert_ok(kvi_store_remove(s, 1, 0));
  assert_ok(kvi_store_remove(ref, 1, 0));
  assert_int_equal(fsize(p1), before_last + 80);
  assert_ok(put_tag(s, 1, 6, 57, 0));
  assert_ok(put_tag(ref, 1, 6, 57, 0));
  kvi_store_destroy(s);
  s = mk_store(f, KVI_DTYPE_BF16, 64, f->dir, "b", 0, 0);
  assert_ok(kvi_store_prefetch(s, 1, NULL, 0, NULL));
  assert_int_equal(count_of(s, 1), 6);
  for (uint64_t id = 1; id < 7; id++) assert_true(same_fact(s, ref, 1, id));
  kvi_store_destroy(s);
  /* a flipped byte inside an entry that is not the last: corrupt, tenant 1 only */
  int fd = open(p1, O_RDWR);
  unsigned char byte;
  const off_t at = fsize(p1) / 2;
  assert_int_equal(pread(fd, &byte, 1, at), 1);
  byte ^= 0x40;
  assert_int_equal(pwrite(fd, &byte, 1, at), 1);
  close(fd);
  s = mk_store(f, KVI_DTYPE_BF16, 64, f->dir, "a", 0, 0);
  assert_status(kvi_store_prefetch(s, 1, NULL, 0, NULL), KVI_ERR_CORRUPT);
  assert_last_error_has("kvi_store_prefetch", p1);
  assert_int_equal(count_of(s, 1), 0);
  assert_status(put_tag(s, 1, 9, 9, 0), KVI_ERR_CORRUPT); /* a write must read it first */
  assert_ok(kvi_store_prefetch(s, 2, NULL, 0, NULL));
  assert_int_equal(count_of(s, 2), 6);
  for (uint64_t id = 0; id < 6; id++) assert_true(same_fact(s, ref, 2, id));
  assert_ok(put_tag(s, 2, 9, 9, 0));
  kvi_store_destroy(s);
  kvi_store_destroy(ref);
}

/* Two processes share the directory: the second writer gets KVI_ERR_LEASED
 * naming the owner while the first's lease holds, takes the tenant over
 * once it ran out and then has the first's facts; a released lease is free
 * at once. */
static void test_two_replicas(void **state) {
  fx *f = *state;
  int to_child[2], to_parent[2];
  assert_int_equal(pipe(to_child), 0);
  assert_int_equal(pipe(to_parent), 0);
  const pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) { /* replica B */
    alarm(30); /* never outlives a parent whose test failed */
    close(to_child[1]);
    close(to_parent[0]);
    char c;
    kvi_store *b = mk_store(f, KVI_DTYPE_BF16, 3, f->dir, "replica-b", 300, 0);
    int rc = 0;
    for (uint64_t id = 0; id < 5 && !rc; id++) rc = put_tag(b, 7, id, id, 0) != KVI_OK;
    if (write(to_parent[1], "1", 1) != 1 || read(to_child[0], &c, 1) != 1) _exit(10);
    /* A took the tenant over after our lease ran out: our write is refused */
    if (!rc && put_tag(b, 7, 50, 50, 0) != KVI_ERR_LEASED) rc = 2;
    if (!rc && !strstr(kvi_last_error(), "replica-a")) rc = 3;
    if (write(to_parent[1], "2", 1) != 1 || read(to_child[0], &c, 1) != 1) _exit(11);
    /* A released: we write at once, and see A's fact */
    if (!rc && put_tag(b, 7, 60, 60, 0) != KVI_OK) rc = 4;
    size_t n = 0;
    if (!rc && (kvi_store_count(b, 7, &n) != KVI_OK || n != 7)) rc = 5;
    kvi_store_destroy(b); /* gives its leases up */
    _exit(rc);
  }
  close(to_child[0]);
  close(to_parent[1]);
  char c;
  assert_int_equal(read(to_parent[0], &c, 1), 1);
  kvi_store *a = mk_store(f, KVI_DTYPE_BF16, 3, f->dir, "replica-a", 300, 0);
  assert_status(put_tag(a, 7, 40, 40, 0), KVI_ERR_LEASED);
  assert_last_error_has("kvi_store_put", "replica-b");
  assert_last_error_has("kvi_store_put", "more ms");
  assert_int_equal(count_of(a, 7), 0); /* nothing changed */
  /* reading needs no lease */
  assert_ok(kvi_store_prefetch(a, 7, NULL, 0, NULL));
  assert_int_equal(count_of(a, 7), 5);
  /* another tenant is free */
  assert_ok(put_tag(a, 8, 1, 1, 0));
  usleep(400 * 1000); /* B's lease runs out */
  assert_ok(put_tag(a, 7, 40, 40, 0));
  assert_int_equal(count_of(a, 7), 6);
  assert_int_equal(write(to_child[1], "x", 1), 1);
  assert_int_equal(read(to_parent[0], &c, 1), 1);
  assert_ok(kvi_store_tenant_release(a, 7));
  assert_int_equal(write(to_child[1], "y", 1), 1);
  int wst = 0;
  assert_int_equal(waitpid(pid, &wst, 0), pid);
  close(to_child[1]);
  close(to_parent[0]);
  assert_true(WIFEXITED(wst));
  assert_int_equal(WEXITSTATUS(wst), 0);
  /* B wrote (and released on destroy): A takes the tenant again and has B's fact */
  assert_ok(put_tag(a, 7, 41, 41, 0));
  assert_int_equal(count_of(a, 7), 8);
  int32_t T;
  assert_ok(kvi_store_fact_tokens(a, 7, 60, &T));
  kvi_store_destroy(a);
}

/* Creation: a missing directory, a file, a directory that cannot be
 * written are KVI_ERR_IO naming the path; a bad owner or lease length is
 * KVI_ERR_INVALID_ARGUMENT; kvi_store_load refuses a disk tier. */
static void test_create_errors(void **state) {
  fx *f = *state;
  kvi_store_options o = cpu_store_options(KVI_DTYPE_BF16, P, 1u << 16);
  kvi_store *s = NULL;
  char path[600];
  snprintf(path, sizeof path, "%s/missing", f->dir);
  o.disk_dir = path;
  assert_status(kvi_store_create(&s, f->m, &o), KVI_ERR_IO);
  assert_last_error_has("kvi_store_create", path);
  assert_null(s);
  snprintf(path, sizeof path, "%s/plain", f->dir);
  fclose(fopen(path, "w"));
  assert_status(kvi_store_create(&s, f->m, &o), KVI_ERR_IO);
  assert_last_error_has("kvi_store_create", "not a directory");
  unlink(path);
  /* a directory no one may create files in, root included */
  o.disk_dir = "/proc/self";
  assert_status(kvi_store_create(&s, f->m, &o), KVI_ERR_IO);
  assert_last_error_has("kvi_store_create", "/proc/self is not writable");
  assert_null(s);
  o.disk_dir = f->dir;
  o.disk_owner = "two\nlines";
  assert_status(kvi_store_create(&s, f->m, &o), KVI_ERR_INVALID_ARGUMENT);
  o.disk_owner = NULL;
  o.disk_lease_ms = -1;
  assert_status(kvi_store_create(&s, f->m, &o), KVI_ERR_INVALID_ARGUMENT);
  o.disk_lease_ms = 0;
  assert_status(kvi_store_load(&s, f->m, &o, path, NULL), KVI_ERR_UNSUPPORTED);
  /* an options struct of an older size: no disk tier */
  kvi_store_options old = cpu_store_options(KVI_DTYPE_BF16, P, 1u << 16);
  old.struct_size = offsetof(kvi_store_options, disk_dir);
  assert_ok(kvi_store_create(&s, f->m, &old));
  assert_int_equal(store_stats(s).disk_writes, 0);
  assert_ok(put_tag(s, 1, 1, 1, 0));
  assert_int_equal(store_stats(s).disk_writes, 0);
  kvi_store_destroy(s);
  s = NULL;
  if (geteuid() == 0) {
    print_message("skipped: a read-only directory (root ignores permissions)\n");
    return;
  }
  assert_int_equal(chmod(f->dir, 0500), 0);
  assert_status(kvi_store_create(&s, f->m, &o), KVI_ERR_IO);
  assert_last_error_has("kvi_store_create", f->dir);
  assert_last_error_has("kvi_store_create", "not writable");
  assert_int_equal(chmod(f->dir, 0700), 0);
}

/* Checks that every fact of `ids` of tenant 3 is injectable. */
static void inject_all(kvi_store *s, const uint64_t *ids, int32_t n) {
  cache *c = calloc(1, sizeof *c);
  cache_make(c, s);
  const int32_t table[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  for (int32_t i = 0; i < n; i++) {
    kvi_inject_request q = KVI_INJECT_REQUEST_INIT;
    q.tenant = 3;
    q.fact_ids = &ids[i];
    q.num_facts = 1;
    q.block_table = table;
    q.block_table_len = 8;
    assert_ok(kvi_inject(c->inj, &q, 1, NULL, NULL));
  }
  kvi_injector_destroy(c->inj);
  free(c);
}

/* A full disk: the byte budget (KVI_ERR_CAPACITY) and, in a child, a file
 * size limit (a write error, KVI_ERR_IO); the failing call changes nothing
 * and the facts stored stay usable. A read-only directory after creation
 * (not as root) fails writes with KVI_ERR_IO in the same way. */
static void test_disk_full(void **state) {
  fx *f = *state;
  kvi_store *s = mk_store(f, KVI_DTYPE_BF16, 64, f->dir, NULL, 0, 8192);
  uint64_t ids[64];
  int32_t n = 0;
  kvi_status st = KVI_OK;
  for (uint64_t id = 0; id < 64 && st == KVI_OK; id++)
    if ((st = put_tag(s, 3, id, id, 0)) == KVI_OK) ids[n++] = id;
  assert_status(st, KVI_ERR_CAPACITY);
  assert_last_error_has("kvi_store_put", "disk_budget_bytes");
  assert_true(n > 2);
  const kvi_store_stats before = store_stats(s);
  assert_int_equal(before.facts, (uint64_t)n);
  assert_true(before.disk_bytes <= 8192);
  int32_t T;
  assert_status(kvi_store_fact_tokens(s, 3, (uint64_t)n, &T), KVI_ERR_NOT_FOUND);
  inject_all(s, ids, n);
  /* removing frees no budget until compaction, but the removal itself may not fit: either way consistent */
  kvi_store_destroy(s);

  /* a write error (EFBIG past RLIMIT_FSIZE, as ENOSPC would be) in a child */
  const pid_t pid = fork();
  if (pid == 0) {
    alarm(30);
    kvi_store *c = mk_store(f, KVI_DTYPE_BF16, 4, f->dir, NULL, 0, 0);
    if (kvi_store_prefetch(c, 3, NULL, 0, NULL) != KVI_OK) _exit(2);
    char p[600];
    tenant_file(f, 3, ".kvi", p, sizeof p);
    signal(SIGXFSZ, SIG_IGN);
    struct rlimit rl = {(rlim_t)fsize(p) + 10, (rlim_t)fsize(p) + 10};
    if (setrlimit(RLIMIT_FSIZE, &rl) != 0) _exit(3);
    const off_t size = fsize(p);
    if (put_tag(c, 3, 100, 100, 0) != KVI_ERR_IO) _exit(4);
    if (!strstr(kvi_last_error(), "File too large")) _exit(5);
    if (fsize(p) != size) _exit(6); /* the partial entry was cut back off */
    size_t cnt = 0;
    if (kvi_store_count(c, 3, &cnt) != KVI_OK || cnt != (size_t)n) _exit(7);
    inject_all(c, ids, n); /* from memory and from disk */
    kvi_store_destroy(c);
    _exit(0);
  }
  int wst = 0;
  assert_int_equal(waitpid(pid, &wst, 0), pid);
  assert_true(WIFEXITED(wst));
  assert_int_equal(WEXITSTATUS(wst), 0);
}

/* A tenant's file holds that tenant's facts only; the same fact ids in two
 * tenants read back each its own bytes; a tenant file holding another
 * tenant's records is refused. */
static void test_tenant_isolation(void **state) {
  fx *f = *state;
  kvi_store *s = mk_store(f, KVI_DTYPE_BF16, 3, f->dir, NULL, 0, 0), *ref = mk_store(f, KVI_DTYPE_BF16, 64, NULL, NULL, 0, 0);
  for (uint64_t id = 0; id < 8; id++)
    for (uint64_t t = 10; t <= 11; t++) {
      assert_ok(put_tag(s, t, id, id * 100 + t, 0));
      assert_ok(put_tag(ref, t, id, id * 100 + t, 0));
    }
  for (uint64_t id = 0; id < 8; id++)
    for (uint64_t t = 10; t <= 11; t++) assert_true(same_fact(s, ref, t, id));
  assert_ok(kvi_store_tenant_release(s, 10));
  assert_ok(kvi_store_tenant_release(s, 11));
  kvi_store_destroy(s);
  /* each file alone holds its tenant: a store that reads one sees only it */
  s = mk_store(f, KVI_DTYPE_BF16, 3, f->dir, NULL, 0, 0);
  assert_ok(kvi_store_prefetch(s, 10, NULL, 0, NULL));
  assert_int_equal(count_of(s, 10), 8);
  assert_int_equal(count_of(s, 11), 0);
  assert_int_equal(store_stats(s).tenants, 1);
  kvi_store_destroy(s);
  /* tenant 11's file under tenant 12's name is refused */
  char p11[600], p12[600];
  tenant_file(f, 11, ".kvi", p11, sizeof p11);
  tenant_file(f, 12, ".kvi", p12, sizeof p12);
  assert_int_equal(link(p11, p12), 0);
  s = mk_store(f, KVI_DTYPE_BF16, 3, f->dir, NULL, 0, 0);
  assert_status(kvi_store_prefetch(s, 12, NULL, 0, NULL), KVI_ERR_CORRUPT);
  assert_last_error_has("kvi_store_prefetch", "tenant 11");
  assert_int_equal(count_of(s, 12), 0);
  assert_ok(kvi_store_prefetch(s, 11, NULL, 0, NULL));
  assert_int_equal(count_of(s, 11), 8);
  kvi_store_destroy(s);
  kvi_store_destroy(ref);
}

/* Replacing and removing facts over and over keeps a tenant's file within
 * a bounded size (it is rewritten once its dead bytes pass its live ones),
 * files are mode 0600, and kvi_store_save writes facts that are on disk. */
static void test_compaction_and_save(void **state) {
  fx *f = *state;
  kvi_store *s = mk_store(f, KVI_DTYPE_BF16, 3, f->dir, NULL, 0, 0), *ref = mk_store(f, KVI_DTYPE_BF16, 64, NULL, NULL, 0, 0);
  char p[600];
  tenant_file(f, 2, ".kvi", p, sizeof p);
  off_t largest = 0;
  for (int i = 0; i < 200; i++) {
    const uint64_t id = (uint64_t)(i % 5);
    assert_ok(put_tag(s, 2, id, (uint64_t)i, KVI_PUT_REPLACE));
    assert_ok(put_tag(ref, 2, id, (uint64_t)i, KVI_PUT_REPLACE));
    if (i % 7 == 6) {
      assert_ok(kvi_store_remove(s, 2, id));
      assert_ok(kvi_store_remove(ref, 2, id));
    }
    if (fsize(p) > largest) largest = fsize(p);
  }
  struct stat sb;
  assert_int_equal(stat(p, &sb), 0);
  assert_int_equal(sb.st_mode & 0777, 0600);
  assert_int_equal(store_stats(s).disk_bytes, (uint64_t)sb.st_size); /* the one tenant file it wrote */
  char lp[600];
  tenant_file(f, 2, ".lease", lp, sizeof lp);
  assert_int_equal(stat(lp, &sb), 0);
  assert_int_equal(sb.st_mode & 0777, 0600);
  /* five facts of at most 9 tokens: a few KiB, not 200 puts' worth */
  assert_true(largest < 16 * 1024);
  for (uint64_t id = 0; id < 5; id++) {
    int32_t T;
    if (kvi_store_fact_tokens(ref, 2, id, &T) == KVI_OK) assert_true(same_fact(s, ref, 2, id));
  }
  /* a save reads the facts on disk from their files */
  assert_true(store_stats(s).facts_on_disk_only > 0);
  char sp[600];
  snprintf(sp, sizeof sp, "%s/saved.store", f->dir);
  assert_ok(kvi_store_save(s, sp, NULL));
  kvi_store *l = NULL;
  kvi_store_options o = cpu_store_options(KVI_DTYPE_BF16, P, 64 * page_bytes(KVI_DTYPE_BF16));
  assert_ok(kvi_store_load(&l, f->m, &o, sp, NULL));
  assert_int_equal(count_of(l, 2), count_of(ref, 2));
  for (uint64_t id = 0; id < 5; id++) {
    int32_t T;
    if (kvi_store_fact_tokens(ref, 2, id, &T) == KVI_OK) assert_true(same_fact(l, ref, 2, id));
  }
  kvi_store_destroy(l);
  kvi_store_destroy(s);
  kvi_store_destroy(ref);
}

static void touch_file(const char *path) {
  const int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  assert_true(fd >= 0);
  assert_int_equal(write(fd, "x", 1), 1);
  close(fd);
}

static bool exists(const char *path) {
  struct stat sb;
  return lstat(path, &sb) == 0;
}

/* Temporaries that a dying writer left in the directory are removed when a
 * store opens it (unlocked ones of any file; a locked one and other names
 * stay), and only then: rewriting a tenant's file does not scan the
 * directory again (one scan per file written made N tenants cost N^2
 * directory entries). */
static void test_stale_temporaries(void **state) {
  fx *f = *state;
  char t5[600], t9[600], held[600], other[600], bad[600], later[600];
  tenant_file(f, 5, ".kvi.tmp.0123456789abcdef", t5, sizeof t5);
  tenant_file(f, 9, ".kvi.tmp.00000000000000aa", t9, sizeof t9);
  tenant_file(f, 6, ".kvi.tmp.fedcba9876543210", held, sizeof held);
  snprintf(other, sizeof other, "%s/notes.txt", f->dir);
  snprintf(bad, sizeof bad, "%s/0000000000000007.kvi.tmp.12", f->dir);
  tenant_file(f, 9, ".kvi.tmp.00000000000000bb", later, sizeof later);
  touch_file(t5);
  touch_file(t9);
  touch_file(held);
  touch_file(other);
  touch_file(bad);
  const int hfd = open(held, O_RDONLY | O_CLOEXEC);
  assert_true(hfd >= 0);
  assert_int_equal(flock(hfd, LOCK_EX | LOCK_NB), 0); /* a live writer's */
  kvi_store *s = mk_store(f, KVI_DTYPE_BF16, 3, f->dir, NULL, 0, 0);
  assert_false(exists(t5));
  assert_false(exists(t9));
  assert_true(exists(held));
  assert_true(exists(other));
  assert_true(exists(bad));
  /* tenant 9's file rewritten many times (replacements past its live bytes): the directory is not scanned */
  touch_file(later);
  char p[600];
  tenant_file(f, 9, ".kvi", p, sizeof p);
  off_t largest = 0;
  for (int i = 0; i < 60; i++) {
    assert_ok(put_tag(s, 9, (uint64_t)(i % 3), (uint64_t)i, KVI_PUT_REPLACE));
    if (fsize(p) > largest) largest = fsize(p);
  }
  assert_true(largest < 16 * 1024); /* it was rewritten: 60 puts' records would be larger */
  assert_true(exists(later));
  kvi_store_destroy(s);
  s = mk_store(f, KVI_DTYPE_BF16, 3, f->dir, NULL, 0, 0);
  assert_false(exists(later));
  assert_true(exists(held));
  kvi_store_destroy(s);
  close(hfd);
  s = mk_store(f, KVI_DTYPE_BF16, 3, f->dir, NULL, 0, 0); /* its writer gone: stale now */
  assert_false(exists(held));
  kvi_store_destroy(s);
}

/* Tenant 6's 20 facts written by one store on the directory, then a fresh
 * store there (*s: it has them on disk only) and a memory-only store with the
 * same facts (*ref). */
static void twenty_on_disk(fx *f, kvi_store **s, kvi_store **ref) {
  *s = mk_store(f, KVI_DTYPE_BF16, 64, f->dir, "a", 0, 0);
  *ref = mk_store(f, KVI_DTYPE_BF16, 64, NULL, NULL, 0, 0);
  for (uint64_t id = 0; id < 20; id++) {
    assert_ok(put_tag(*s, 6, id, id + 3, 0));
    assert_ok(put_tag(*ref, 6, id, id + 3, 0));
  }
  kvi_store_destroy(*s);
  *s = mk_store(f, KVI_DTYPE_BF16, 64, f->dir, "a", 0, 0);
}

/* Prefetch reads on the store's I/O thread: readers that come before it is
 * done wait for its reads (each fact is read once), and reads, prefetches
 * and writes from several threads at once leave every fact byte-exact. */
static void test_async_prefetch(void **state) {
  fx *f = *state;
  kvi_store *s, *ref;
  twenty_on_disk(f, &s, &ref);
  assert_ok(kvi_store_prefetch(s, 6, NULL, 0, NULL));
  for (uint64_t id = 20; id-- > 0;) assert_true(same_fact(s, ref, 6, id)); /* the last queued first */
  kvi_store_stats st = store_stats(s);
  assert_int_equal(st.disk_reads, 20); /* once each: no reader read a fact the thread was reading */
  assert_int_equal(st.facts_on_disk_only, 0);
  kvi_store_destroy(s);
  kvi_store_destroy(ref);
}

/* kvi_store_prefetch_wait: once it returns every read the prefetch started is
 * published (no fact on disk only, each read once, before any reader asked
 * for them), the facts byte-exact; with nothing under way, or without a disk
 * tier, it returns at once; a NULL store is an argument error. */
static void test_prefetch_wait(void **state) {
  fx *f = *state;
  kvi_store *s, *ref;
  twenty_on_disk(f, &s, &ref);
  assert_ok(kvi_store_prefetch_wait(s)); /* no read under way yet */
  assert_ok(kvi_store_prefetch(s, 6, NULL, 0, NULL));
  assert_ok(kvi_store_prefetch_wait(s));
  kvi_store_stats st = store_stats(s);
  assert_int_equal(st.facts_on_disk_only, 0);
  assert_int_equal(st.disk_reads, 20);
  for (uint64_t id = 0; id < 20; id++) {
    int32_t tier = -1;
    assert_ok(kvi_store_fact_tier(s, 6, id, &tier));
    assert_int_equal(tier, KVI_TIER_HOST);
    assert_true(same_fact(s, ref, 6, id));
  }
  assert_int_equal(store_stats(s).disk_reads, 20); /* the readers found them in memory */
  assert_ok(kvi_store_prefetch_wait(s));
  assert_ok(kvi_store_prefetch_wait(ref)); /* no disk tier */
  assert_status(kvi_store_prefetch_wait(NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_store_prefetch_wait", "NULL");
  kvi_store_destroy(s);
  kvi_store_destroy(ref);
}

/* Drops choose the least recently used facts: put, read back from disk and
 * injected facts become the most recent (one-page facts in 4 pages). */
/* Many tenants under a low descriptor limit: a store keeps at most a few
 * hundred tenant files open (closing the least recently used, reopening on
 * use), so 1,500 tenants written, dropped, read back and removed from work
 * with RLIMIT_NOFILE at 400 (before, two descriptors stayed open per tenant:
 * the writes failed with EMFILE). In a child: the limit stays there. */
static void test_many_tenants_few_descriptors(void **state) {
  fx *f = *state;
  fflush(NULL);
  const pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    struct rlimit rl = {400, 400};
    (void)setrlimit(RLIMIT_NOFILE, &rl); /* where a tool refuses it, the rest still runs */
    kvi_store *s = mk_store(f, KVI_DTYPE_BF16, 8, f->dir, NULL, 0, 0), *ref = mk_store(f, KVI_DTYPE_BF16, 8192, NULL, NULL, 0, 0);
    if (!s || !ref) _exit(3);
    enum { T = 1500 };
    for (uint64_t t = 1; t <= T; t++)
      if (put_tag(s, t, 7, t * 31, 0) != KVI_OK || put_tag(ref, t, 7, t * 31, 0) != KVI_OK) _exit(4);
    for (uint64_t t = 1; t <= T; t++) /* most were dropped: read back from their files */
      if (!same_fact(s, ref, t, 7)) _exit(5);
    for (uint64_t t = 1; t <= T; t += 7) /* writes to tenants whose files were closed */
      if (kvi_store_remove(s, t, 7) != KVI_OK || put_tag(s, t, 8, t, 0) != KVI_OK || put_tag(ref, t, 8, t, 0) != KVI_OK)
        _exit(6);
    kvi_store_destroy(s);
    s = mk_store(f, KVI_DTYPE_BF16, 8, f->dir, NULL, 0, 0); /* every file as the store left it */
    for (uint64_t t = 1; t <= T; t += 7) {
      int32_t n;
      if (kvi_store_prefetch(s, t, NULL, 0, NULL) != KVI_OK || kvi_store_fact_tokens(s, t, 7, &n) != KVI_ERR_NOT_FOUND ||
          !same_fact(s, ref, t, 8))
        _exit(7);
    }
    kvi_store_destroy(s);
    kvi_store_destroy(ref);
    _exit(0);
  }
  int ws = 0;
  assert_int_equal(waitpid(pid, &ws, 0), pid);
  assert_true(WIFEXITED(ws));
  assert_int_equal(WEXITSTATUS(ws), 0);
}

static void test_lru_order(void **state) {
  fx *f = *state;
  kvi_store *s = mk_store(f, KVI_DTYPE_BF16, 4, f->dir, NULL, 0, 0), *ref = mk_store(f, KVI_DTYPE_BF16, 64, NULL, NULL, 0, 0);
  for (uint64_t id = 0; id < 6; id++) { /* tag 9 id + 1: 2 tokens; 4 and 5 drop 0 and 1 */
    assert_ok(put_tag(s, 3, id, 9 * id + 1, 0));
    assert_ok(put_tag(ref, 3, id, 9 * id + 1, 0));
  }
  assert_int_equal(tier_of(s, 3, 0), KVI_TIER_DISK);
  assert_int_equal(tier_of(s, 3, 1), KVI_TIER_DISK);
  assert_true(same_fact(s, ref, 3, 0)); /* read back: drops 2 */
  const uint64_t three = 3;
  inject_all(s, &three, 1); /* 3 becomes the most recent */
  assert_ok(put_tag(s, 3, 6, 9 * 6 + 1, 0)); /* drops 4 */
  assert_ok(put_tag(ref, 3, 6, 9 * 6 + 1, 0));
  static const int32_t want[7] = {KVI_TIER_HOST, KVI_TIER_DISK, KVI_TIER_DISK, KVI_TIER_HOST,
                                  KVI_TIER_DISK, KVI_TIER_HOST, KVI_TIER_HOST};
  for (uint64_t id = 0; id < 7; id++) assert_int_equal(tier_of(s, 3, id), want[id]);
  for (uint64_t id = 0; id < 7; id++) assert_true(same_fact(s, ref, 3, id));
  kvi_store_destroy(s);
  kvi_store_destroy(ref);
}

typedef struct worker {
  kvi_store *s, *ref;
  int kind;
  bool ok;
} worker;

static void *work(void *arg) {
  worker *w = arg;
  w->ok = true;
  for (int i = 0; i < 150 && w->ok; i++) {
    const uint64_t id = (uint64_t)(i * 7 + w->kind) % 20;
    if (w->kind == 0)
      w->ok = kvi_store_prefetch(w->s, 6, NULL, 0, NULL) == KVI_OK && kvi_store_prefetch_wait(w->s) == KVI_OK;
    else if (w->kind == 1) w->ok = same_fact(w->s, w->ref, 6, id);
    else w->ok = put_tag(w->s, 7, id, id, KVI_PUT_REPLACE) == KVI_OK;
  }
  return NULL;
}

static void test_async_threads(void **state) {
  fx *f = *state;
  kvi_store *s = mk_store(f, KVI_DTYPE_BF16, 8, f->dir, "a", 0, 0), *ref = mk_store(f, KVI_DTYPE_BF16, 64, NULL, NULL, 0, 0);
  for (uint64_t id = 0; id < 20; id++) {
    assert_ok(put_tag(s, 6, id, id + 3, 0));
    assert_ok(put_tag(ref, 6, id, id + 3, 0));
  }
  worker w[4] = {{s, ref, 0, false}, {s, ref, 1, false}, {s, ref, 2, false}, {s, ref, 1, false}};
  pthread_t th[4];
  for (int i = 0; i < 4; i++) assert_int_equal(pthread_create(&th[i], NULL, work, &w[i]), 0);
  for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < 4; i++) assert_true(w[i].ok);
  for (uint64_t id = 0; id < 20; id++) assert_true(same_fact(s, ref, 6, id));
  kvi_store_destroy(s);
  kvi_store_destroy(ref);
}

/* Captures (kvi_encode) write through like puts: after the store is gone,
 * another store reads them from the file as the memory-only store has them. */
static void test_encode_writes_through(void **state) {
  fx *f = *state;
  float *pool = encode3_cache(f, __func__);
  kvi_store *s = mk_store(f, KVI_DTYPE_BF16, 3, f->dir, NULL, 0, 0), *ref = mk_store(f, KVI_DTYPE_BF16, 64, NULL, NULL, 0, 0);
  for (uint64_t id = 0; id < 3; id++) { /* memory full: the captures drop these */
    assert_ok(put_tag(s, 5, id, id, 0));
    assert_ok(put_tag(ref, 5, id, id, 0));
  }
  const uint64_t writes = store_stats(s).disk_writes;
  encode3(f, s, pool);
  encode3(f, ref, pool);
  assert_int_equal(store_stats(s).disk_writes, writes + 1); /* one entry for the call */
  for (uint64_t id = 0; id < 3; id++) assert_true(same_fact(s, ref, 5, id));
  kvi_store_destroy(s);
  s = mk_store(f, KVI_DTYPE_BF16, 3, f->dir, NULL, 0, 0);
  assert_ok(kvi_store_prefetch(s, 5, NULL, 0, NULL));
  assert_int_equal(count_of(s, 5), 6);
  for (uint64_t id = 0; id < 3; id++) assert_true(same_fact(s, ref, 5, id));
  for (uint64_t id = 10; id < 13; id++) assert_true(same_fact(s, ref, 5, id));
  kvi_store_destroy(s);
  kvi_store_destroy(ref);
  free(pool);
}

/* The facts of one call are one entry of the tenant file: reading them back
 * reads that entry once, not once a fact (before, a prefetch of n facts an
 * encode call captured read its entry n times: 8 s for a 51-fact user of an
 * 8B model in vLLM). Then bytes equal to a memory-only store's. */
static void test_entry_read_once(void **state) {
  fx *f = *state;
  float *pool = encode3_cache(f, __func__);
  kvi_store *s = mk_store(f, KVI_DTYPE_BF16, 3, f->dir, NULL, 0, 0), *ref = mk_store(f, KVI_DTYPE_BF16, 64, NULL, NULL, 0, 0);
  assert_ok(put_tag(s, 5, 99, 1, 0)); /* the tenant file exists: the call appends its entry alone */
  const uint64_t written = store_stats(s).disk_write_bytes;
  encode3(f, s, pool);
  encode3(f, ref, pool);
  const uint64_t entry = store_stats(s).disk_write_bytes - written; /* one entry, three facts of a page each */
  for (uint64_t id = 0; id < 3; id++) assert_ok(put_tag(s, 5, id, 1, 0)); /* memory full: 10..12 drop */
  for (uint64_t id = 10; id < 13; id++) assert_int_equal(tier_of(s, 5, id), KVI_TIER_DISK);
  const kvi_store_stats before = store_stats(s);
  const uint64_t ids[] = {10, 11, 12};
  assert_ok(kvi_store_prefetch(s, 5, ids, 3, NULL));
  assert_ok(kvi_store_prefetch_wait(s));
  const kvi_store_stats after = store_stats(s);
  assert_int_equal(after.disk_reads - before.disk_reads, 3);
  assert_int_equal(after.disk_read_bytes - before.disk_read_bytes, entry);
  for (uint64_t id = 10; id < 13; id++) {
    assert_int_not_equal(tier_of(s, 5, id), KVI_TIER_DISK);
    assert_true(same_fact(s, ref, 5, id));
  }
  /* read back one at a time (each read drops the one before): each read is its own */
  for (uint64_t id = 0; id < 3; id++) assert_true(same_fact(s, s, 5, id));
  const uint64_t one = store_stats(s).disk_read_bytes;
  assert_true(same_fact(s, ref, 5, 10));
  assert_int_equal(store_stats(s).disk_read_bytes - one, entry);
  kvi_store_destroy(s);
  kvi_store_destroy(ref);
  free(pool);
}

/* The tenants kvi_store_disk_changes lists, drained, sorted, as one number
 * per tenant (tenant ids below 10) in a decimal string: "12" is tenants 1, 2. */
static unsigned long long changes_of(kvi_store *s, size_t cap) {
  uint64_t got[16];
  size_t n = 0, total = 0;
  do {
    assert_ok(kvi_store_disk_changes(s, got + total, cap, &n));
    total += n;
  } while (n == cap && cap > 0 && total + cap <= 16);
  unsigned long long out = 0;
  for (uint64_t t = 0; t < 10; t++)
    for (size_t i = 0; i < total; i++)
      if (got[i] == t) {
        out = out * 10 + t;
        break;
      }
  return out;
}

/* kvi_store_disk_changes lists the tenants whose disk-only facts changed (a
 * drop, a read back, a removal of a fact on disk, a tenant indexed from its
 * file), each once, and takes them off: an engine asks about those, not
 * about every tenant after every change (the vLLM worker re-listed every
 * tenant it had reported, a C call a fact, at every step with a drop or a
 * read back). */
static void test_disk_changes(void **state) {
  fx *f = *state;
  kvi_store *s = mk_store(f, KVI_DTYPE_BF16, 3, f->dir, NULL, 0, 0);
  size_t n = 99;
  assert_ok(kvi_store_disk_changes(s, NULL, 0, &n));
  assert_int_equal(n, 0);
  for (uint64_t id = 0; id < 3; id++) assert_ok(put_tag(s, 1, id, 1, 0)); /* one page each: memory full */
  assert_int_equal(changes_of(s, 4), 0);                                   /* nothing dropped yet */
  assert_ok(put_tag(s, 2, 0, 1, 0)); /* drops tenant 1's oldest */
  assert_int_equal(tier_of(s, 1, 0), KVI_TIER_DISK);
  assert_ok(kvi_store_disk_changes(s, NULL, 0, &n)); /* capacity 0 takes nothing */
  assert_int_equal(n, 0);
  assert_int_equal(changes_of(s, 4), 1);
  assert_int_equal(changes_of(s, 4), 0); /* taken */
  size_t m = 0;
  float *x = read_fact(s, 1, 0, &m); /* read back: drops tenant 1's fact 1 */
  assert_non_null(x);
  free(x);
  assert_int_equal(tier_of(s, 1, 1), KVI_TIER_DISK);
  assert_int_equal(changes_of(s, 4), 1); /* once, for two changes */
  x = read_fact(s, 2, 0, &m);            /* in memory: nothing changes */
  free(x);
  assert_int_equal(changes_of(s, 4), 0);
  assert_ok(put_tag(s, 3, 0, 1, 0));
  assert_ok(put_tag(s, 4, 0, 1, 0)); /* drops two more, tenants 1 and 2's */
  assert_int_equal(changes_of(s, 1), 12); /* one at a time */
  assert_ok(kvi_store_remove(s, 1, 1)); /* a fact on disk */
  assert_int_equal(changes_of(s, 4), 1);
  kvi_store_destroy(s);
  s = mk_store(f, KVI_DTYPE_BF16, 3, f->dir, NULL, 0, 0);
  assert_ok(kvi_store_prefetch(s, 2, NULL, 0, NULL)); /* indexed from its file, then read back */
  assert_ok(kvi_store_prefetch_wait(s));
  assert_int_equal(changes_of(s, 4), 2);
  /* errors change nothing */
  uint64_t t[2];
  assert_status(kvi_store_disk_changes(NULL, t, 2, &n), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_store_disk_changes", "store is NULL");
  assert_status(kvi_store_disk_changes(s, t, 2, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_store_disk_changes", "count is NULL");
  assert_status(kvi_store_disk_changes(s, NULL, 2, &n), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_store_disk_changes", "tenants is NULL");
  kvi_store_destroy(s);
  kvi_store *mem = mk_store(f, KVI_DTYPE_BF16, 2, NULL, NULL, 0, 0); /* no disk tier: none, ever */
  assert_ok(put_tag(mem, 1, 0, 1, 0));
  assert_ok(put_tag(mem, 1, 1, 1, 0));
  assert_int_equal(changes_of(mem, 4), 0);
  kvi_store_destroy(mem);
}

/* kvi_store_list_on_disk against kvi_store_fact_tier of every listed fact,
 * as a decimal string of the ids (all below 10): "13" is facts 1 and 3. */
static unsigned long long on_disk_of(const kvi_store *s, uint64_t tenant) {
  uint64_t ids[16], all[16];
  size_t n = 99, total = 0;
  assert_ok(kvi_store_list_on_disk(s, tenant, ids, 16, &n));
  assert_ok(kvi_store_list(s, tenant, all, 16, &total));
  unsigned long long out = 0;
  size_t k = 0;
  for (size_t i = 0; i < total; i++) /* ascending, as kvi_store_list */
    if (tier_of(s, tenant, all[i]) == KVI_TIER_DISK) {
      assert_true(k < n && ids[k] == all[i]);
      k++;
      out = out * 10 + all[i];
    }
  assert_int_equal(k, n);
  return out;
}

/* kvi_store_list_on_disk: one call for what fact_tier says fact by fact,
 * through drops, reads back, a removal on disk and a store that indexes
 * the tenant from its file; a short array gets the first ids and the total. */
static void test_list_on_disk(void **state) {
  fx *f = *state;
  kvi_store *s = mk_store(f, KVI_DTYPE_BF16, 3, f->dir, NULL, 0, 0);
  for (uint64_t id = 1; id <= 5; id++) assert_ok(put_tag(s, 1, id, 1, 0)); /* a page each: 1, 2 drop */
  assert_int_equal(on_disk_of(s, 1), 12);
  uint64_t one[1];
  size_t n = 0;
  assert_ok(kvi_store_list_on_disk(s, 1, one, 1, &n));
  assert_int_equal(n, 2);
  assert_int_equal(one[0], 1);
  assert_ok(kvi_store_list_on_disk(s, 1, NULL, 0, &n)); /* sizing */
  assert_int_equal(n, 2);
  assert_true(same_fact(s, s, 1, 2)); /* read back: 3 drops */
  assert_int_equal(on_disk_of(s, 1), 13);
  assert_ok(kvi_store_remove(s, 1, 1)); /* removed while on disk */
  assert_int_equal(on_disk_of(s, 1), 3);
  assert_ok(kvi_store_list_on_disk(s, 9, one, 1, &n)); /* a tenant never seen */
  assert_int_equal(n, 0);
  kvi_store_destroy(s);
  s = mk_store(f, KVI_DTYPE_BF16, 3, f->dir, NULL, 0, 0);
  const uint64_t first[] = {2};
  assert_ok(kvi_store_prefetch(s, 1, NULL, 0, NULL)); /* indexed from its file; as many as fit read back */
  assert_ok(kvi_store_prefetch_wait(s));
  assert_ok(kvi_store_prefetch(s, 1, first, 1, NULL));
  assert_ok(kvi_store_prefetch_wait(s));
  assert_int_not_equal(tier_of(s, 1, 2), KVI_TIER_DISK);
  (void)on_disk_of(s, 1); /* whatever did not fit, as fact_tier says */
  /* errors */
  assert_status(kvi_store_list_on_disk(NULL, 1, one, 1, &n), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_store_list_on_disk", "store is NULL");
  assert_status(kvi_store_list_on_disk(s, 1, one, 1, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_store_list_on_disk", "out_total is NULL");
  assert_status(kvi_store_list_on_disk(s, 1, NULL, 1, &n), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_store_list_on_disk", "ids is NULL");
  kvi_store_destroy(s);
  kvi_store *mem = mk_store(f, KVI_DTYPE_BF16, 2, NULL, NULL, 0, 0); /* no disk tier: none */
  assert_ok(put_tag(mem, 1, 0, 1, 0));
  assert_ok(kvi_store_list_on_disk(mem, 1, one, 1, &n));
  assert_int_equal(n, 0);
  kvi_store_destroy(mem);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_tier_moves_roundtrip, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_tiny_budget_many_facts, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_inject_from_disk, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_kill_during_write, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_kill_during_prefetch, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_torn_and_corrupt_files, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_two_replicas, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_create_errors, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_disk_full, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_tenant_isolation, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_compaction_and_save, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_stale_temporaries, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_async_prefetch, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_prefetch_wait, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_lru_order, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_many_tenants_few_descriptors, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_async_threads, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_encode_writes_through, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_entry_read_once, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_disk_changes, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_list_on_disk, fx_setup, fx_teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
