/*
 * libFuzzer target for sequences of API calls: the input's bytes are decoded
 * into calls (put, replace, remove, read, list, count, stats, search,
 * inject, encode, retrieve_inject, prefetch, fact_tokens, get_embedding) on
 * a small CPU store with its injector and encoder over a host cache. A
 * shadow model (the facts' K/V and embeddings, the cache's contents, page
 * accounting) predicts every call's status and outputs; after every call
 * the store's observable state (every tenant's list and count, the stats,
 * every fact read back, every cache element) must equal the model. So a
 * failed call must have changed nothing, and a successful one exactly what
 * it promises. abort() on any difference (libFuzzer reports it).
 *
 * The geometry is tiny (1 layer, 1 KV head of 4, NoPE, fp32 storage: every
 * value round-trips exactly), pages of 2 tokens, 12 pages, 4 tenants of 6
 * ids, 8 cache slots, so capacity, replacement and reserve limits are hit.
 *
 * SPDX-License-Identifier: Apache-2.0
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kvinject.h>

enum { D = 4, P = 2, PAGES = 12, TENANTS = 4, IDS = 6, BS = 2, NB = 4, SLOTS = NB * BS, MAX_T = 8, DIM = 2 };

typedef struct sfact {
  int present;
  int32_t T;
  float k[MAX_T][D], v[MAX_T][D];
  float emb[DIM];
} sfact;

typedef struct shadow {
  sfact f[TENANTS][IDS];
  int32_t reserve_t[TENANTS]; /* longest fact since the tenant last had none */
  float ck[NB][BS][D], cv[NB][BS][D];
} shadow;

static kvi_model *model;
static shadow S;
static float cache[2][NB][BS][1][D]; /* one layer: [2, NB, BS, H, D] */

#define CHECK(cond, ...)                                                                      \
  do {                                                                                        \
    if (!(cond)) {                                                                            \
      fprintf(stderr, "fuzz_api: ");                                                          \
      fprintf(stderr, __VA_ARGS__);                                                           \
      fprintf(stderr, " (line %d; kvi_last_error: %s)\n", __LINE__, kvi_last_error());      \
      abort();                                                                                \
    }                                                                                         \
  } while (0)

typedef struct input {
  const uint8_t *p;
  size_t n;
} input;

static unsigned byte(input *in) {
  if (!in->n) return 0;
  in->n--;
  return *in->p++;
}

static int32_t pages_of(int32_t T) { return (T + P - 1) / P; }

static int32_t pages_used(void) {
  int32_t n = 0;
  for (int t = 0; t < TENANTS; t++)
    for (int i = 0; i < IDS; i++)
      if (S.f[t][i].present) n += pages_of(S.f[t][i].T);
  return n;
}

static int32_t facts_of(int t) {
  int32_t n = 0;
  for (int i = 0; i < IDS; i++) n += S.f[t][i].present;
  return n;
}

static void after_change(int t) { /* the reserve resets when the tenant has no facts */
  if (facts_of(t) == 0) S.reserve_t[t] = 0;
}

/* The store and the cache equal the shadow. */
static void check_all(kvi_store *s) {
  kvi_store_stats st = KVI_STORE_STATS_INIT;
  CHECK(kvi_store_stats_get(s, &st) == KVI_OK, "stats");
  uint64_t facts = 0, tenants = 0;
  for (int t = 0; t < TENANTS; t++) {
    facts += (uint64_t)facts_of(t);
    tenants += facts_of(t) > 0;
    uint64_t ids[IDS + 1];
    size_t total = 99, count = 99;
    CHECK(kvi_store_list(s, (uint64_t)t, ids, IDS + 1, &total) == KVI_OK, "list");
    CHECK(kvi_store_count(s, (uint64_t)t, &count) == KVI_OK, "count");
    CHECK(total == (size_t)facts_of(t) && count == total, "tenant %d: list %zu, count %zu, model %d", t, total, count,
          (int)facts_of(t));
    size_t j = 0;
    for (int i = 0; i < IDS; i++) {
      const sfact *f = &S.f[t][i];
      if (!f->present) continue;
      CHECK(ids[j++] == (uint64_t)i, "tenant %d: list[%zu] is %llu, model %d", t, j - 1, (unsigned long long)ids[j - 1], i);
      float k[MAX_T][D], v[MAX_T][D], e[DIM];
      kvi_kv_view out;
      kvi_kv_view_contiguous(&out, KVI_MEMORY_HOST, KVI_DTYPE_FP32, 1, f->T, 1, D, k, v);
      CHECK(kvi_store_read(s, (uint64_t)t, (uint64_t)i, &out, NULL) == KVI_OK, "read (%d, %d)", t, i);
      CHECK(memcmp(k, f->k, sizeof(float) * D * (size_t)f->T) == 0 && memcmp(v, f->v, sizeof(float) * D * (size_t)f->T) == 0,
            "fact (%d, %d) reads other values", t, i);
      CHECK(kvi_store_get_embedding(s, (uint64_t)t, (uint64_t)i, e) == KVI_OK && memcmp(e, f->emb, sizeof e) == 0,
            "fact (%d, %d): embedding", t, i);
    }
  }
  CHECK(st.facts == facts && st.tenants == tenants, "stats: %llu facts in %llu tenants, model %llu in %llu",
        (unsigned long long)st.facts, (unsigned long long)st.tenants, (unsigned long long)facts,
        (unsigned long long)tenants);
  CHECK(st.pages_total == PAGES && st.pages_used == (uint64_t)pages_used(), "stats: %llu pages used, model %d",
        (unsigned long long)st.pages_used, (int)pages_used());
  for (int b = 0; b < NB; b++)
    for (int x = 0; x < BS; x++)
      CHECK(memcmp(cache[0][b][x][0], S.ck[b][x], sizeof S.ck[b][x]) == 0 &&
                memcmp(cache[1][b][x][0], S.cv[b][x], sizeof S.cv[b][x]) == 0,
            "cache block %d slot %d differs from the model", b, x);
}

static float small(input *in) { return (float)((int)(byte(in) % 9) - 4); }

/* The block table is the identity over the cache's blocks (its length from the input). */
static const int32_t table[NB] = {0, 1, 2, 3};

static void cache_slot(int64_t s, float **k, float **v, float **sk, float **sv) {
  const int b = (int)(s / BS), x = (int)(s % BS);
  *k = cache[0][b][x][0], *v = cache[1][b][x][0], *sk = S.ck[b][x], *sv = S.cv[b][x];
}

/* What an injection of the facts `ids` of tenant t from `first` writes, into the shadow cache. */
static void shadow_inject(int t, const uint64_t *ids, int n, int64_t first) {
  int64_t s = first;
  for (int i = 0; i < n; i++) {
    const sfact *f = &S.f[t][ids[i]];
    for (int32_t x = 0; x < f->T; x++, s++) {
      float *k, *v, *sk, *sv;
      cache_slot(s, &k, &v, &sk, &sv);
      memcpy(sk, f->k[x], sizeof f->k[x]);
      memcpy(sv, f->v[x], sizeof f->v[x]);
    }
  }
}

static int32_t status_in(kvi_status st, kvi_status a, kvi_status b) { return st == a || st == b; }

/* Search results of the model: the facts of t by score (desc), then id (asc). */
static int shadow_search(int t, const float *q, int k, uint64_t *ids, float *scores) {
  int n = 0;
  for (int i = 0; i < IDS; i++)
    if (S.f[t][i].present) {
      float sc = (float)((double)q[0] * S.f[t][i].emb[0] + (double)q[1] * S.f[t][i].emb[1]);
      int j = n++;
      while (j > 0 && scores[j - 1] < sc) ids[j] = ids[j - 1], scores[j] = scores[j - 1], j--; /* ties: smaller id first */
      ids[j] = (uint64_t)i, scores[j] = sc;
    }
  return n < k ? n : k;
}

static void step(input *in, kvi_store *s, kvi_injector *inj, kvi_encoder *enc) {
  const unsigned op = byte(in) % 10;
  const int t = (int)(byte(in) % TENANTS);
  const unsigned id = byte(in) % IDS;
  sfact *f = &S.f[t][id];
  kvi_status st;
  switch (op) {
  case 0: { /* put, maybe replacing; T 0..8 (0 is refused) */
    const int32_t T = (int32_t)(byte(in) % (MAX_T + 1));
    const uint32_t flags = byte(in) & 1u ? KVI_PUT_REPLACE : 0u;
    sfact nf = {1, T, {{0}}, {{0}}, {0}};
    for (int32_t x = 0; x < T; x++)
      for (int d = 0; d < D; d++) nf.k[x][d] = small(in), nf.v[x][d] = small(in);
    nf.emb[0] = small(in), nf.emb[1] = small(in);
    kvi_kv_view kv;
    kvi_kv_view_contiguous(&kv, KVI_MEMORY_HOST, KVI_DTYPE_FP32, 1, T, 1, D, nf.k, nf.v);
    kvi_put_options po = KVI_PUT_OPTIONS_INIT;
    po.flags = flags, po.embedding = nf.emb;
    st = kvi_store_put(s, (uint64_t)t, id, &kv, &po, NULL);
    const kvi_status want = T < 1 ? KVI_ERR_INVALID_ARGUMENT
                            : f->present && !flags ? KVI_ERR_EXISTS
                            : PAGES - pages_used() < pages_of(T) ? KVI_ERR_CAPACITY
                                                                  : KVI_OK;
    CHECK(st == want, "put(%d, %u, T %d, flags %u): %d, model %d", t, id, (int)T, flags, (int)st, (int)want);
    if (st == KVI_OK) {
      *f = nf;
      if (T > S.reserve_t[t]) S.reserve_t[t] = T;
    }
    break;
  }
  case 1: /* remove */
    st = kvi_store_remove(s, (uint64_t)t, id);
    CHECK(st == (f->present ? KVI_OK : KVI_ERR_NOT_FOUND), "remove(%d, %u): %d", t, id, (int)st);
    f->present = 0;
    after_change(t);
    break;
  case 2: { /* read with a token count that may be wrong; fact_tokens */
    const int32_t T = f->present && (byte(in) & 1) ? f->T : (int32_t)(1 + byte(in) % MAX_T);
    float k[MAX_T][D], v[MAX_T][D];
    kvi_kv_view out;
    kvi_kv_view_contiguous(&out, KVI_MEMORY_HOST, KVI_DTYPE_FP32, 1, T, 1, D, k, v);
    st = kvi_store_read(s, (uint64_t)t, id, &out, NULL);
    CHECK(st == (!f->present ? KVI_ERR_NOT_FOUND : T != f->T ? KVI_ERR_MISMATCH : KVI_OK), "read(%d, %u, T %d): %d", t, id,
          (int)T, (int)st);
    int32_t got = -1;
    st = kvi_store_fact_tokens(s, (uint64_t)t, id, &got);
    CHECK(f->present ? st == KVI_OK && got == f->T : st == KVI_ERR_NOT_FOUND, "fact_tokens(%d, %u): %d", t, id, (int)st);
    break;
  }
  case 3: { /* list with a short capacity */
    const size_t cap = byte(in) % (IDS + 1);
    uint64_t ids[IDS];
    size_t total = 99;
    CHECK(kvi_store_list(s, (uint64_t)t, cap ? ids : NULL, cap, &total) == KVI_OK && total == (size_t)facts_of(t),
          "list(%d, capacity %zu)", t, cap);
    break;
  }
  case 4: { /* search: k 0..4 (0 is refused) */
    const int k = (int)(byte(in) % 5);
    float q[DIM] = {small(in), small(in)}, scores[4], ms[IDS];
    uint64_t ids[4], mi[IDS];
    int32_t count = -1;
    const uint64_t tenant = (uint64_t)t;
    st = kvi_store_search(s, q, 1, DIM, &tenant, k, ids, scores, &count, NULL, NULL);
    if (k == 0) {
      CHECK(st == KVI_ERR_INVALID_ARGUMENT && count == -1, "search with k 0: %d", (int)st);
      break;
    }
    const int n = shadow_search(t, q, k, mi, ms);
    CHECK(st == KVI_OK && count == n, "search(%d, k %d): %d, count %d, model %d", t, k, (int)st, (int)count, n);
    for (int i = 0; i < k; i++)
      CHECK(i < n ? ids[i] == mi[i] && scores[i] == ms[i] : ids[i] == KVI_SEARCH_NO_ID && scores[i] == -INFINITY,
            "search(%d, k %d): result %d", t, k, i);
    break;
  }
  case 5: case 6: { /* inject 0..2 facts from first_slot, table of 1..4 blocks */
    const int n = (int)(byte(in) % 3);
    uint64_t ids[2] = {id, byte(in) % IDS};
    const int64_t first = byte(in) % SLOTS;
    const int32_t len = (int32_t)(1 + byte(in) % NB);
    kvi_inject_request rq = KVI_INJECT_REQUEST_INIT;
    rq.tenant = (uint64_t)t, rq.fact_ids = ids, rq.num_facts = n, rq.block_table = table, rq.block_table_len = len;
    rq.first_slot = first;
    st = kvi_inject(inj, &rq, 1, NULL, NULL);
    int unknown = 0;
    int64_t tokens = 0;
    for (int i = 0; i < n; i++) {
      if (!S.f[t][ids[i]].present) unknown = 1;
      else tokens += S.f[t][ids[i]].T;
    }
    const int range = !unknown && n > 0 && first + tokens > (int64_t)len * BS;
    if (unknown) CHECK(status_in(st, KVI_ERR_NOT_FOUND, KVI_ERR_INVALID_ARGUMENT), "inject of an unknown fact: %d", (int)st);
    else if (range) CHECK(st == KVI_ERR_INVALID_ARGUMENT, "inject past the block table: %d", (int)st);
    else {
      CHECK(st == KVI_OK, "inject(%d, %d facts from %lld, table %d): %d", t, n, (long long)first, (int)len, (int)st);
      shadow_inject(t, ids, n, first);
    }
    break;
  }
  case 7: { /* encode T tokens from first_slot into (t, id) */
    const int32_t T = (int32_t)(1 + byte(in) % MAX_T);
    const int64_t first = byte(in) % SLOTS;
    const uint32_t flags = byte(in) & 1u ? KVI_PUT_REPLACE : 0u;
    float emb[DIM] = {small(in), small(in)};
    kvi_capture c = KVI_CAPTURE_INIT;
    c.tenant = (uint64_t)t, c.fact_id = id, c.block_table = table, c.block_table_len = NB, c.first_slot = first;
    c.num_tokens = T, c.flags = flags, c.embedding = emb;
    st = kvi_encode(enc, &c, 1, NULL);
    const int free_pages = PAGES - pages_used();
    if (first + T > SLOTS) CHECK(st == KVI_ERR_INVALID_ARGUMENT || (f->present && !flags && st == KVI_ERR_EXISTS),
                                 "encode past the table: %d", (int)st);
    else if (f->present && !flags) CHECK(st == KVI_ERR_EXISTS, "encode over a fact without replace: %d", (int)st);
    else if (free_pages < pages_of(T)) CHECK(st == KVI_ERR_CAPACITY, "encode without room: %d", (int)st);
    else CHECK(st == KVI_OK, "encode(%d, %u, T %d from %lld): %d", t, id, (int)T, (long long)first, (int)st);
    if (st == KVI_OK) {
      f->present = 1, f->T = T;
      memcpy(f->emb, emb, sizeof emb);
      for (int32_t x = 0; x < T; x++) {
        float *k, *v, *sk, *sv;
        cache_slot(first + x, &k, &v, &sk, &sv);
        memcpy(f->k[x], sk, sizeof f->k[x]);
        memcpy(f->v[x], sv, sizeof f->v[x]);
      }
      if (T > S.reserve_t[t]) S.reserve_t[t] = T;
    }
    break;
  }
  case 8: { /* retrieve_inject: k 1..3 from first_slot */
    const int k = (int)(1 + byte(in) % 3);
    const int64_t first = byte(in) % SLOTS;
    const uint32_t best_last = byte(in) & 1u;
    float q[DIM] = {small(in), small(in)}, ms[IDS];
    uint64_t ids[3], mi[IDS];
    int32_t count = -1, tokens = -1;
    kvi_retrieve_request rr = KVI_RETRIEVE_REQUEST_INIT;
    rr.tenant = (uint64_t)t, rr.block_table = table, rr.block_table_len = NB, rr.first_slot = first;
    rr.flags = best_last ? KVI_RETRIEVE_BEST_LAST : 0u;
    st = kvi_retrieve_inject(inj, q, 1, DIM, &rr, k, NULL, ids, &count, &tokens, NULL);
    const int n = shadow_search(t, q, k, mi, ms);
    const int64_t reserve = (int64_t)n * S.reserve_t[t];
    if (n > 0 && first + reserve > SLOTS) {
      CHECK(st == KVI_ERR_INVALID_ARGUMENT && count == -1, "retrieve_inject without the reserve: %d", (int)st);
      break;
    }
    CHECK(st == KVI_OK && count == n, "retrieve_inject(%d, k %d from %lld): %d, count %d, model %d", t, k, (long long)first,
          (int)st, (int)count, n);
    int32_t want_tokens = 0;
    for (int i = 0; i < n; i++) want_tokens += S.f[t][mi[i]].T;
    CHECK(tokens == want_tokens, "retrieve_inject: %d tokens, model %d", (int)tokens, (int)want_tokens);
    uint64_t order[3];
    for (int i = 0; i < n; i++) {
      CHECK(ids[i] == mi[i], "retrieve_inject: result %d", i);
      order[i] = best_last ? mi[n - 1 - i] : mi[i];
    }
    shadow_inject(t, order, n, first);
    break;
  }
  default: { /* prefetch: all, or two ids that may be unknown */
    const int all = byte(in) & 1;
    const uint64_t ids[2] = {id, byte(in) % IDS};
    st = kvi_store_prefetch(s, (uint64_t)t, all ? NULL : ids, all ? 0 : 2, NULL);
    CHECK(st == (all || (S.f[t][ids[0]].present && S.f[t][ids[1]].present) ? KVI_OK : KVI_ERR_NOT_FOUND),
          "prefetch: %d", (int)st);
    break;
  }
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!model) {
    kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
    mo.num_layers = 1, mo.num_kv_heads = 1, mo.head_size = D;
    CHECK(kvi_model_create(&model, &mo) == KVI_OK, "model");
    kvi_rope_spec rs = KVI_ROPE_SPEC_INIT;
    rs.style = KVI_ROPE_NONE; /* the shadow model compares cache elements as stored */
    CHECK(kvi_model_set_rope(model, -1, &rs) == KVI_OK, "rope");
  }
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.backend = KVI_BACKEND_CPU, so.dtype = KVI_DTYPE_FP32, so.page_tokens = P;
  so.budget_bytes = (uint64_t)PAGES * P * 2 * D * sizeof(float), so.embedding_dim = DIM;
  kvi_store *s;
  CHECK(kvi_store_create(&s, model, &so) == KVI_OK, "store");
  memset(&S, 0, sizeof S);
  memset(cache, 0, sizeof cache);
  void *layers[1] = {cache};
  kvi_cache_layout cl;
  CHECK(kvi_cache_layout_preset(&cl, KVI_CACHE_VLLM_FLASH_ATTN, KVI_DTYPE_FP32, 1, 1, D, BS, NB, layers, NULL, NULL) ==
            KVI_OK, "layout");
  cl.memory = KVI_MEMORY_HOST;
  kvi_injector *inj;
  kvi_encoder *enc;
  CHECK(kvi_injector_create(&inj, s, &cl, NULL) == KVI_OK && kvi_encoder_create(&enc, s, &cl, NULL) == KVI_OK, "handles");
  input in = {data, size};
  for (int calls = 0; in.n > 0 && calls < 256; calls++) {
    step(&in, s, inj, enc);
    check_all(s);
  }
  kvi_encoder_destroy(enc);
  kvi_injector_destroy(inj);
  kvi_store_destroy(s);
  return 0;
}
