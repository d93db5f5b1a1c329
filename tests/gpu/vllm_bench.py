#!/usr/bin/env python3
"""Time to first token and throughput inside vLLM on a GPU: the kvinject
connector against re-prefill and against vLLM's own prefix cache (APC), each
engine kind built in a subprocess of its own (one engine per process: two 8B
engines do not share a GPU cleanly, and a killed run leaves nothing behind):

  connector  the connector loaded, prefix caching off. Serves
             prefill   [header | k facts | pad | question] as plain tokens,
                       vLLM prefills all of it (a request without memory);
             inject    the same prompt with [header | facts | pad] injected
                       from the store (kvinject.vllm.memory_prompt): vLLM
                       prefills the question alone.
  apc        no connector, prefix caching on. Serves
             apc       the same prompt, its [header | facts | pad] in vLLM's
                       prefix cache (sent once first, with another question):
                       vLLM prefills the question alone. The floor: the target
                       is inject <= 1.05 x apc at every k.
  plain      no connector, prefix caching off. Serves
             prefill   as the connector engine's: does loading the connector
                       slow requests without memory (target: within 5%)?
  shared     (not among the defaults: --engines shared) the connector loaded,
             prefix caching on. Serves apc and inject as above, in one engine
             process: injected / APC without the engines' process-to-process
             differences, and whether the connector slows a request vLLM's
             prefix cache serves (against the apc engine's).
  cold       (not among the defaults: --engines cold, or added to the list)
             the connector with a disk tier (disk_dir: OUT/cold-disk-<key>,
             made fresh at the start, removed at the end) and hybrid serving,
             its store's memory --cold-store-mb (default 1.25 x the pages of
             one user's [header | facts | pad] at the largest k in the store's
             dtype: 255 MiB for the 8B's fixed shape at k = 50), prefix caching
             off. Users: one tenant per (k, rep), --cold-reps (10) at each k
             of --k but 0, each with the workload's facts. All are captured
             first, one prefill each ([header | k facts | pad | question],
             capture_prompt), in k order, so the later ones push the earlier
             ones' facts out of memory to disk; then, in the same order, per
             user:
             reprefill [header | k facts | pad | question] as plain tokens
                       (the control);
             cold      the same prompt with its facts injected-as-asked
                       (memory_prompt): they are only on disk, and the
                       scheduler's hybrid plan prefills them as text (or awaits
                       a read it predicts faster) and prefetches them;
             (twice a pause, --cold-settle-ms, and a small plain request:
              steps that bring the finished prefetch's report to the
              scheduler; --cold-settle-prefetch: the first a prefetch
              request of the user, kv.prefetch_prompt, whose Store.prefetch
              publishes the reads the store finished: a CUDA store publishes
              them only at a call that needs them)
             warm      another question with the same facts injected, now from
                       memory.
             Target: cold <= 1.05 x reprefill at every k. Reported per k: the
             medians, the engine core's part, the cold requests that injected
             nothing and the warm ones that injected every fact (each
             request's outcome, kv_transfer_params["kvinject"], or, pending
             after one token, the worker's inject events of its time), and
             the scheduler's hybrid decisions (its events): a warm request
             that did not inject every fact (decisions text) was planned
             before the workers reported the prefetch done and its facts in
             memory. The plan's rates
             are settings: --cold-read-mb-s (disk_read_mb_s; 0: measured) and
             --cold-prefill-tokens-s (prefill_tokens_s; default 1e9: every
             disk-only fact is text, the case the target is about; give the
             engine's measured prefill rate to let the plan await reads).

pad: vLLM's prefix cache keeps whole blocks only, so each k's [header | facts]
is followed by pad_k filler tokens (0 .. block-1) that make it a whole number
of blocks (--no-align: none); the pad is part of the injected prefix (a fact
of its own, captured per k) and of every kind's prompt. The APC requests'
num_cached_tokens is reported against the prefix's tokens.

Before timing, the connector engine captures the header and all facts from
one prefill of [header | facts | question] (capture_prompt: each fact's KV
computed after everything before it), then each k's pad after [header | k
facts], so the injected KV is the KV re-prefill computes (up to the store's
dtype) at the same positions.

Shapes (--shape, random token ids; the model's weights are random too):
  fixed  a 32-token header, k facts of 24 tokens, a 32-token question;
         k = 0, 5, 10, 20, 50;
  paper  Mem0-like facts of 10 to 20 tokens (drawn per fact), a 40-token
         chat-template-like header, a 15-token question; k = 5, 10, 20, 50.
--header-tokens, --fact-tokens (N or LO-HI), --question-tokens, --k override.
Every timed request has a question of its own (drawn from its tag: the same
in every engine), so vLLM's prefix cache never holds a question's blocks.

Measured, per engine:
  TTFT        one request at a time, wall time of LLM.generate with
              max_tokens=1 (parameters made with skip_clone, as vLLM's
              OpenAI server makes them); --warmup calls of each kind first,
              then --reps calls of each kind interleaved; medians; and of
              vLLM's request metrics the engine core's part, scheduled to
              first token (the rest: input processing, queue, IPC, output);
  throughput  --concurrency requests submitted together at the largest k,
              requests/s (median of --tput-reps after one warm-up; fresh
              questions every call), for each of --tput-tokens; request i
              is user i mod --tput-users (default 1: every request has the
              same facts, so APC's requests share one cached prefix: the
              same blocks, nothing written per request; with U users each
              has facts of its own, of the same lengths, captured into its
              own tenant, and APC caches each user's prefix in the warm-up:
              a memory service's many users); the
              connector engine (prefill, inject) and apc engine (apc);
  connector   from its events: host time in start_load_kv per injecting
              step; with --device-timing (the connector's time_device: an
              event synchronize per step, which costs TTFT) also the
              injection's device time and the step's device time.
              With --no-events the connector's engines run without an event
              file, as a production engine does (every injecting step then
              builds and queues no records, and no request's end waits for
              their writer): captures are checked by the requests' outcomes,
              and there is no connector share.

--profile DIR: instead of the sweep, each engine (default connector, apc)
runs its engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0),
times --reps requests per kind at --profile-k (in-process TTFT, unprofiled),
then wraps --profile-requests requests of each kind in torch.profiler (CPU +
CUDA activities, record_shapes off, Python stacks only with --profile-stack:
they slow the host several times over) and writes
DIR/<engine>-<kind>-k<k>.trace.json.gz (chrome://tracing, ui.perfetto.dev),
DIR/<engine>-<kind>-k<k>.ops.txt (torch's operator table) and DIR/profile.md:
per kind the host-side functions with most self and inclusive time per
request, device time per request, and the GPU's idle gaps within requests by
what the host was doing meanwhile. --profile-timers N first times N more
requests of each kind without the profiler, with a perf_counter around each
function HOST_TIMERS names (vLLM's scheduler and model runner, the connector's
hooks, the binding) and Python's garbage collections: host µs per request,
function by function, the same functions in both engines.

--rounds N: the engines run N times in turn (connector, apc, connector, apc,
...), --reps requests of each kind every time. The engines run one after the
other, and a GPU machine can have slow and fast phases lasting seconds: one
engine's medians may come from a slow phase, the other's from a fast one. In
rounds both meet them; the report pools each kind's requests over the rounds
(medians, spread, the order plot) and gives each round's injected / APC.
Throughput, the connector's share and the engine's start are round 1's.

Results: each engine writes OUT/part-<engine>-<key>.json (or
DIR/profile-<engine>-<key>.json; round r > 1: -<key>-r<r-1>.json) when it is done; key is a hash of the
arguments that shape the figures. A part already there with the same key is
not measured again (--redo: measure again), so a run cut off or split over
several commands goes on where it stopped; --time-budget S starts no engine
that would end past S seconds (by the longest engine run so far; exit 3:
engines left, run the same command again). Every command writes
OUT/vllm_bench.json, OUT/vllm_bench.md merged from the parts present, and (where
matplotlib is) OUT/vllm_bench.png (TTFT against k) and OUT/vllm_bench-order.png
(each request's TTFT in the order measured, one panel per k).

    python3 tests/gpu/vllm_bench.py --model DIR --out DIR [--shape paper] [--dummy] [--eager]
        [--engines connector,apc,plain,cold] [--rounds N] [--cold-reps N] [--time-budget S] [--profile DIR]
    python3 tests/gpu/vllm_bench.py --engine connector|apc|plain|cold ...   (one engine, in this process)
    python3 tests/gpu/vllm_bench.py --report DIR [--model DIR ...]     (merge the parts; no vLLM needed;
                   without the run's arguments, every run in DIR: vllm_bench-<key>.md when several)
    python3 tests/gpu/vllm_bench.py --report X --profile DIR           (DIR/profile.md from its parts)

Before building an engine, the weights (from config.json: fp8 linear layers
where its quantization_config says fp8), an activation allowance and the KV
cache of one --max-model-len sequence are checked against the GPU's memory
(nvidia-smi) at --gpu-mem (default: 0.6 for weights under 20 GiB, as the
8B runs before, else all but the store and 4 GiB, at most 0.95): an engine that cannot fit is refused with the
figures (exit 2).

Needs vLLM and kvinject importable, KVINJECT_LIBRARY pointing at a build of
libkvinject (CUDA on the GPU machine).
"""
import argparse
import bisect
import gzip
import hashlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time

TENANT, HEADER_ID, PAD_ID = 7, 1000, 5000   # fact ids: header 1000, facts 1001.., pad of k 5000 + k
ENGINES = {  # engine kind: its vLLM settings and the request kinds it serves
    "connector": dict(connector=True, prefix_caching=False, ttft=("prefill", "inject"), tput=("prefill", "inject")),
    "apc": dict(connector=False, prefix_caching=True, ttft=("apc",), tput=("apc",)),
    "plain": dict(connector=False, prefix_caching=False, ttft=("prefill",), tput=()),
    # the connector with vLLM's prefix cache on: injected and APC requests of the same
    # prompt in one engine process (not among the defaults: --engines shared)
    "shared": dict(connector=True, prefix_caching=True, ttft=("apc", "inject"), tput=()),
    # not among the defaults: --engines cold (or added to the list)
    "cold": dict(connector=True, prefix_caching=False, cold=True, ttft=(), tput=()),
}
SHAPES = {"fixed": dict(header=32, fact="24", question=32, k="0,5,10,20,50"),
          "paper": dict(header=40, fact="10-20", question=15, k="5,10,20,50")}
# the arguments that shape the figures: a part is reused only when they are the same
KEY_ARGS = ("model", "shape", "k", "header_tokens", "fact_tokens", "question_tokens", "no_align", "block_size",
            "concurrency", "tput_tokens", "tput_users", "reps", "warmup", "tput_reps", "store_dtype", "store_mb", "gpu_mem",
            "max_model_len", "max_batched_tokens", "layerwise", "model_runner", "eager", "dummy", "device_timing",
            "no_events", "seed",
            "profile", "profile_k", "profile_requests", "profile_stack", "cold_reps", "cold_store_mb",
            "cold_read_mb_s", "cold_prefill_tokens_s", "cold_settle_ms", "cold_settle_prefetch", "rounds")
TARGET_FLOOR = 1.05      # inject TTFT <= 1.05 x apc TTFT; connector's prefill <= 1.05 x plain's;
                         # a cold user's first request <= 1.05 x the re-prefill of its prompt
COLD_TENANT = 100000     # the cold engine's users: tenants 100000, 100001, ... (one per k and rep)
STORE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8_e4m3": 1, "q4": 1}   # per KV value (q4: an upper bound)
PAGE_TOKENS = 16         # the connector's page_tokens (its default; the bench does not set it)
TARGET_TPUT = 10.0       # inject requests/s >= 10 x re-prefill's at the highest concurrency, largest k


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def paired_ratio(a, b, boots=4000, seed=0):
    """The median of b[i] / a[i] over pairs of requests measured one right after the
    other (a kind's request i, then the other kind's with the same question), with its
    95% bootstrap interval (pairs drawn with replacement, percentile bounds): a drift of
    the machine between stretches of requests moves both of a pair and cancels in
    it. (median, low, high), or None with fewer than 5 pairs."""
    r = sorted(y / x for x, y in zip(a or [], b or []) if x and y)
    if len(r) < 5:
        return None
    rnd = random.Random(seed)
    n = len(r)
    bs = sorted(statistics.median([r[rnd.randrange(n)] for _ in range(n)]) for _ in range(boots))
    return statistics.median(r), bs[int(0.025 * boots)], bs[int(0.975 * boots) - 1]


def quartiles(xs):
    """(25th, 75th) percentile of xs (linear between ranks), None without values."""
    v = [x for x in xs or [] if x is not None]
    if len(v) < 2:
        return (v[0], v[0]) if v else None
    q = statistics.quantiles(v, n=4, method="inclusive")
    return q[0], q[2]


def log(*a):
    print("vllm_bench:", *a, flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (config.json; weights unless --dummy)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--engine", default="all", choices=["all"] + list(ENGINES),
                    help="all: each of --engines in a subprocess, then the report; else that engine here")
    ap.add_argument("--engines", default=None, help="engines of --engine all (default connector,apc,plain; "
                                                    "connector,apc with --profile)")
    ap.add_argument("--report", metavar="DIR", help="write DIR/vllm_bench.md from the parts in DIR and stop")
    ap.add_argument("--redo", action="store_true", help="measure again engines whose part is there")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the engines this many times in turn (connector, apc, connector, apc, ...), "
                         "--reps requests each time; the report pools the rounds and gives each round's "
                         "ratios (a machine's slow phases then fall on both engines)")
    ap.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)   # the child's round
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)   # run by the driver: no report
    ap.add_argument("--time-budget", type=float, default=0, help="seconds; 0: no limit")
    ap.add_argument("--shape", default="fixed", choices=sorted(SHAPES))
    ap.add_argument("--k", default=None, help="fact counts (default: the shape's)")
    ap.add_argument("--header-tokens", type=int, default=None)
    ap.add_argument("--fact-tokens", default=None, help="N, or LO-HI drawn per fact")
    ap.add_argument("--question-tokens", type=int, default=None)
    ap.add_argument("--no-align", action="store_true", help="no pad: [header | facts] not block-aligned")
    ap.add_argument("--block-size", type=int, default=16, help="vLLM's block size, every engine")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--tput-tokens", default="1,16", help="output tokens per request in the throughput runs")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tput-reps", type=int, default=3)
    ap.add_argument("--tput-users", type=int, default=1,
                    help="users the throughput requests cycle through (each its own facts and tenant); the "
                         "connector's store is raised to hold them all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--store-dtype", default="bf16")
    ap.add_argument("--store-mb", type=int, default=1024)
    ap.add_argument("--gpu-mem", type=float, default=None, help="vLLM gpu_memory_utilization (default: see above)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-batched-tokens", type=int, default=None, help="max_num_batched_tokens (vLLM's default)")
    ap.add_argument("--layerwise", action="store_true")
    ap.add_argument("--model-runner", choices=("default", "v1", "v2"), default="default",
                    help="vLLM's model runner (VLLM_USE_V2_MODEL_RUNNER): its first calls the connector's "
                         "handle_preemptions before it prepares a step's inputs, its second (vLLM 0.23's "
                         "default for Llama models) right before start_load_kv")
    ap.add_argument("--eager", action="store_true", help="enforce_eager (no CUDA graphs, no torch.compile)")
    ap.add_argument("--dummy", action="store_true", help="load_format='dummy' (the model directory holds a config)")
    ap.add_argument("--device-timing", action="store_true",
                    help="the connector times each injecting step on the GPU (time_device: an event "
                         "synchronize per step, so TTFT is measured without it)")
    ap.add_argument("--no-events", action="store_true",
                    help="the connector's engines without an event file, as a production engine runs them (the "
                         "event records cost host time in every injecting step and at each request's end): "
                         "captures are checked by the requests' outcomes, and the connector's share of the "
                         "host time is not reported; not with the cold engine")
    ap.add_argument("--profile", metavar="DIR", default=None, help="profile instead of the sweep (see above)")
    ap.add_argument("--profile-k", type=int, default=None, help="k of the profiled requests (default: the largest)")
    ap.add_argument("--profile-requests", type=int, default=5)
    ap.add_argument("--profile-stack", action="store_true",
                    help="record Python frames too (names the host's functions, but slows the host several "
                         "times: the GPU then waits on it everywhere, and its idle gaps say little)")
    ap.add_argument("--profile-timers", type=int, default=0, metavar="N",
                    help="profile: N more requests of each kind, unprofiled, with a perf_counter around each "
                         "of HOST_TIMERS' functions (vLLM's scheduler and model runner, the connector's "
                         "hooks, the binding): their host time per request, in both engines")
    ap.add_argument("--cold-reps", type=int, default=10, help="cold engine: users per k (k = 0 left out)")
    ap.add_argument("--cold-store-mb", type=int, default=None,
                    help="cold engine: store_budget_mb (default: 1.25 users' facts at the largest k)")
    ap.add_argument("--cold-read-mb-s", type=float, default=0.0,
                    help="cold engine: the connector's disk_read_mb_s (0: measured by its injections)")
    ap.add_argument("--cold-prefill-tokens-s", type=float, default=1e9,
                    help="cold engine: the connector's prefill_tokens_s (default 1e9: every disk-only fact "
                         "is text; a measured rate lets it await reads it predicts faster)")
    ap.add_argument("--cold-settle-ms", type=float, default=100.0,
                    help="cold engine: pause after a cold request before the plain requests that carry "
                         "the prefetch's report to the scheduler")
    ap.add_argument("--cold-settle-prefetch", action="store_true",
                    help="cold engine: the first of those requests asks for a prefetch of the user's tenant "
                         "(prefetch_prompt), whose Store.prefetch also publishes the reads the store finished "
                         "(a CUDA store publishes them only at its next call that needs them)")
    args = ap.parse_args(argv)
    if not args.report and not args.model:
        ap.error("--model is needed (or --report DIR)")
    sh = SHAPES[args.shape]
    for name, key in (("header_tokens", "header"), ("fact_tokens", "fact"), ("question_tokens", "question"),
                      ("k", "k")):
        if getattr(args, name) is None:
            setattr(args, name, sh[key])
    if args.engines is None:
        args.engines = "connector,apc" if args.profile else "connector,apc,plain"
    if args.rounds < 1 or not 0 <= args.round < args.rounds:
        ap.error("--rounds must be at least 1")
    if args.model:
        args.model = os.path.abspath(args.model)
    if args.profile and "cold" in args.engines.split(",") or args.profile and args.engine == "cold":
        ap.error("--profile profiles the connector, apc and plain engines, not cold")
    if args.no_events and ("cold" in args.engines.split(",") or args.engine == "cold"):
        ap.error("--no-events: the cold engine's outcomes are read from its events")
    if args.profile_k is not None and args.profile_k not in lists(args)[0]:
        ap.error("--profile-k %d is none of --k %s" % (args.profile_k, args.k))
    return args


def lists(args):
    ks = [int(x) for x in str(args.k).split(",")]
    lo, _, hi = str(args.fact_tokens).partition("-")
    return ks, [int(x) for x in args.concurrency.split(",")], [int(x) for x in args.tput_tokens.split(",")], \
        (int(lo), int(hi or lo))


def run_key(args):
    d = {a: getattr(args, a) for a in KEY_ARGS}
    d["profile"] = bool(d["profile"])
    d["model"] = os.path.basename(d["model"].rstrip("/"))   # /dev/shm or /tmp: the same model
    return hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:10]


def part_path(args, engine, rnd=None):
    """The engine's part of this run (of round rnd, default --round; round 0's
    name has no round suffix)."""
    rnd = args.round if rnd is None else rnd
    suffix = "-r%d" % rnd if rnd else ""
    if args.profile:
        return os.path.join(args.profile, "profile-%s-%s%s.json" % (engine, run_key(args), suffix))
    return os.path.join(args.out, "part-%s-%s%s.json" % (engine, run_key(args), suffix))


# ---------------------------------------------------------------- the requests

class Workload:
    """Token ids of every request, the same in every engine process (drawn from
    the seed and each item's tag)."""

    def __init__(self, args, vocab, block):
        self.seed, self.vocab = args.seed, vocab
        ks, _, _, (flo, fhi) = lists(args)
        rng = random.Random("%d/facts" % args.seed)
        self.header = self.draw(rng, args.header_tokens)
        self.facts = [self.draw(rng, rng.randint(flo, fhi)) for _ in range(max(ks))]
        self.fact_ids = [HEADER_ID + 1 + i for i in range(max(ks))]
        self.users = {0: self.facts}   # user u > 0: facts of user 0's lengths, tokens of its own
        self.qlen = args.question_tokens
        self.pads = {}
        for k in ks:
            n = 0 if args.no_align else -self.prefix_len(k, False) % block
            self.pads[k] = self.draw(random.Random("%d/pad/%d" % (args.seed, k)), n)

    def draw(self, rng, n):
        return [rng.randrange(100, self.vocab - 1) for _ in range(n)]

    def prefix_len(self, k, pad=True):
        return len(self.header) + sum(len(f) for f in self.facts[:k]) + (len(self.pads[k]) if pad else 0)

    def question(self, *tag):
        return self.draw(random.Random("%d/q/%s" % (self.seed, "/".join(map(str, tag)))), self.qlen)

    def facts_of(self, user):
        if user not in self.users:
            rng = random.Random("%d/facts/user%d" % (self.seed, user))
            self.users[user] = [self.draw(rng, len(f)) for f in self.facts]
        return self.users[user]

    def segments(self, k, user=0):
        """[(fact id, tokens)] of the prefix of k facts: header, facts, pad (one pad per k:
        every user's facts have user 0's lengths)."""
        out = [(HEADER_ID, self.header)] + list(zip(self.fact_ids[:k], self.facts_of(user)[:k]))
        if self.pads[k]:
            out.append((PAD_ID + k, self.pads[k]))
        return out

    def request(self, kind, k, question, n_out=1, user=0):
        """(prompt, SamplingParams) of one request of kind prefill / apc / inject, of a user
        (tenant TENANT + user)."""
        from vllm import SamplingParams
        ign = n_out > 1
        if kind == "inject":
            import kvinject.vllm as kv
            mp = kv.memory_prompt(TENANT + user, self.segments(k, user), question)
            return mp.prompt, mp.sampling_params(temperature=0.0, max_tokens=n_out, ignore_eos=ign,
                                                 skip_clone=True)
        ids = [t for _, seg in self.segments(k, user) for t in seg] + list(question)
        # skip_clone: each request's parameters are its own, as the OpenAI server makes them
        # (LLM.generate would deep-copy them per request, the kvinject parameters included)
        return {"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=ign,
                                                         skip_clone=True)


# ---------------------------------------------------------------- memory

def users_store_mb(args, cfg, wl, k, users):
    """MiB of store memory for `users` users' [header | k facts | pad] as the
    store lays them out (each segment in whole pages of PAGE_TOKENS tokens in
    the store's dtype), with a quarter more: 24-token facts take two 16-token
    pages, 1.33 x their tokens."""
    page = model_bytes(cfg)[1] // 2 * STORE_BYTES[args.store_dtype] * PAGE_TOKENS
    pages = sum(-(-len(seg) // PAGE_TOKENS) for _, seg in wl.segments(k))
    return max(1, -(-int(1.25 * users * pages * page) // (1 << 20)))


def model_bytes(cfg):
    """(weight bytes, KV-cache bytes per token, activation bytes per batched token)
    of a dense decoder from its config.json: linear layers in fp8 when its
    quantization_config says fp8, else 2 bytes; embeddings 2 bytes; bf16 KV."""
    H, I, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads", nh)
    hd = cfg.get("head_dim") or H // nh
    fp8 = "fp8" in str((cfg.get("quantization_config") or {}).get("quant_method", ""))
    linear = L * (2 * H * nh * hd + 2 * H * nkv * hd + 3 * H * I)
    embed = cfg["vocab_size"] * H * (1 if cfg.get("tie_word_embeddings") else 2)
    return linear * (1 if fp8 else 2) + embed * 2, L * 2 * nkv * hd * 2, (2 * I + 4 * H) * 2


def gpu_bytes(what="total"):
    """The first GPU's memory.total or memory.used (nvidia-smi), None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.%s" % what, "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout.split()
        return int(out[0]) << 20 if out else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def wait_gpu_free(limit_s=60):
    """Until the GPU holds under 2 GiB (the last engine's processes gone)."""
    t = time.time()
    while time.time() - t < limit_s:
        used = gpu_bytes("used")
        if used is None or used < 2 << 30:
            return
        time.sleep(2)
    log("WARNING: the GPU still holds %.1f GiB after %d s" % (gpu_bytes("used") / 2**30, limit_s))


def fit(args, cfg, store_mb):
    """gpu_memory_utilization to use and the estimate; SystemExit(2) when the
    model cannot fit (no check without a GPU)."""
    G = 1 << 30
    w, kv_tok, act_tok = model_bytes(cfg)
    total = gpu_bytes("total")
    est = {"weights_gib": w / G, "kv_kib_per_token": kv_tok / 1024, "gpu_gib": total / G if total else None}
    if not total:
        est["gpu_mem"] = args.gpu_mem or 0.6
        return est
    act = (args.max_batched_tokens or 16384) * act_tok + G      # activations of one step, logits, slack
    reserve = store_mb * (1 << 20) + 4 * G                 # the store and CUDA graphs, outside vLLM's share
    gm = args.gpu_mem
    if gm is None:
        gm = 0.6 if w < 20 * G else min(0.95, 1 - reserve / total)   # 0.6: the 8B runs before issue 32
    kv = gm * total - w - act
    est.update(gpu_mem=gm, activation_gib=act / G, kv_cache_gib=kv / G, kv_tokens=int(max(kv, 0) // kv_tok))
    log("memory: weights %.1f GiB, activations ~%.1f GiB, KV cache ~%.1f GiB (%d tokens of %.0f KiB) at "
        "gpu_memory_utilization %.2f of %.1f GiB; store %d MiB outside" % (
            w / G, act / G, kv / G, est["kv_tokens"], kv_tok / 1024, gm, total / G, store_mb))
    if est["kv_tokens"] < args.max_model_len or (1 - gm) * total < reserve - 2 * G:
        raise SystemExit("vllm_bench: refused: this model cannot fit on this GPU (%.1f GiB): weights %.1f GiB + "
                         "activations ~%.1f GiB + one %d-token sequence's KV cache (%.2f GiB) need more than "
                         "gpu_memory_utilization %.2f gives (%.1f GiB), with %d MiB of store and ~2 GiB of CUDA "
                         "graphs beside it" % (total / G, w / G, act / G, args.max_model_len,
                                               args.max_model_len * kv_tok / G, gm, gm * total / G, store_mb))
    ks, concs, outs, (_, fhi) = lists(args)
    need = max(concs) * (args.header_tokens + max(ks) * fhi + args.block_size + args.question_tokens + max(outs))
    if est["kv_tokens"] < need:
        log("memory: %d concurrent requests at k = %d need up to %d tokens of KV cache: vLLM will queue some"
            % (max(concs), max(ks), need))
    return est


# ---------------------------------------------------------------- one engine

def run_engine(args):
    spec = ENGINES[args.engine]
    if args.model_runner != "default":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.model_runner == "v2" else "0"
    if args.profile:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"   # the engine core in this process, for the profiler
        os.makedirs(args.profile, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    t_all = time.time()
    ks, concs, tput_tokens, _ = lists(args)
    kmax = max(ks)
    with open(os.path.join(args.model, "config.json")) as f:
        cfg = json.load(f)
    wl = Workload(args, cfg["vocab_size"], args.block_size)
    store_mb = args.store_mb
    if spec["connector"] and args.tput_users > 1:   # every user's [header | facts | pad] at the largest k
        store_mb = max(store_mb, users_store_mb(args, cfg, wl, kmax, args.tput_users))
    mem = fit(args, cfg, store_mb)
    mem["store_mb"] = store_mb
    res = {"engine": args.engine, "key": run_key(args), "round": args.round, "args": vars(args), "memory": mem,
           "pads": {k: len(p) for k, p in wl.pads.items()},
           "prefix_tokens": {k: wl.prefix_len(k) for k in ks}}
    # .worker0.jsonl, .scheduler.jsonl; the cold engine's apart (same key as the connector engine's)
    ev_path = os.path.join(args.out, "events-%s%s" % ("cold-" if spec.get("cold") else "", res["key"]))
    for suffix in (".worker0.jsonl", ".scheduler.jsonl"):
        if spec["connector"] and os.path.exists(ev_path + suffix):
            os.remove(ev_path + suffix)

    import torch
    import vllm
    from vllm import LLM
    import kvinject
    import kvinject.vllm as kv

    # no CUDA call in this process before the engine is up (vLLM forks its engine core)
    res["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__,
                       "kvinject": getattr(kvinject, "__version__", None), "gpu": None}
    log("engine %s: vllm %s, torch %s, prefix tokens %s (pads %s)" % (
        args.engine, vllm.__version__, torch.__version__, res["prefix_tokens"], res["pads"]))
    engine = dict(model=args.model, dtype="bfloat16", enable_prefix_caching=spec["prefix_caching"], seed=0,
                  gpu_memory_utilization=mem["gpu_mem"], max_model_len=args.max_model_len,
                  max_num_seqs=max(64, max(concs)), enforce_eager=args.eager, block_size=args.block_size,
                  disable_log_stats=False)  # RequestOutput.metrics: the engine core's own timestamps
    if spec["connector"]:
        extra = dict(store_dtype=args.store_dtype, store_budget_mb=store_mb, layerwise=args.layerwise,
                     time_device=args.device_timing)
        if not args.no_events:
            extra["events_path"] = ev_path
        if spec.get("cold"):
            extra.update(cold_settings(args, cfg, wl, ks))
            res["cold_settings"] = extra
        engine["kv_transfer_config"] = kv.kv_transfer_config(**extra)
    if args.max_batched_tokens:
        engine["max_num_batched_tokens"] = args.max_batched_tokens
    if args.dummy:
        engine["load_format"] = "dummy"
    t0 = time.time()
    llm = LLM(**engine)
    res["engine_start_s"] = time.time() - t0
    try:
        vc = llm.llm_engine.vllm_config
        res["engine_config"] = {"cudagraph_mode": str(vc.compilation_config.cudagraph_mode),
                                "compilation_mode": str(getattr(vc.compilation_config, "mode", None)),
                                "block_size": vc.cache_config.block_size,
                                "prefix_caching": vc.cache_config.enable_prefix_caching,
                                "quantization": vc.model_config.quantization,
                                "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens}
        if vc.cache_config.block_size != args.block_size:
            log("WARNING: the engine's block size is %s, not --block-size %d: pads miss the block edge"
                % (vc.cache_config.block_size, args.block_size))
    except Exception as e:  # the config's shape differs between versions: report, go on
        res["engine_config"] = {"error": repr(e)}
    if torch.cuda.is_available():
        res["versions"]["gpu"] = torch.cuda.get_device_name(0)
    log("engine %s up in %.0f s: %s" % (args.engine, res["engine_start_s"], res["engine_config"]))

    def events(which="worker0"):
        p = "%s.%s.jsonl" % (ev_path, which)
        if not os.path.exists(p):
            return []
        with open(p) as f:
            return [json.loads(line) for line in f if line.strip()]

    def gen(reqs):
        t = time.perf_counter()
        outs = llm.generate([r[0] for r in reqs], [r[1] for r in reqs], use_tqdm=False)
        dt = time.perf_counter() - t
        bad = [o for o in outs if o.outputs[0].finish_reason == "error" or not o.outputs[0].token_ids]
        if bad:
            raise SystemExit("vllm_bench: %d requests failed (finish reason %s)"
                             % (len(bad), bad[0].outputs[0].finish_reason))
        return dt, outs

    if spec["connector"] and not spec.get("cold"):
        capture(gen, None if args.no_events else events, wl, ks, res, args.tput_users if spec["tput"] else 1)

    windows = []  # (label, t0, t1) in time.time(), to assign the connector's events

    def timed(label, reqs):
        a = time.time()
        dt, outs = gen(reqs)
        windows.append((label, a, time.time()))
        return dt, outs

    if spec.get("cold"):
        cold_users(args, gen, events, wl, ks, res)
    elif args.profile:
        profile(args, spec, wl, gen, res, kmax if args.profile_k is None else args.profile_k)
    else:
        res["ttft"] = ttft_sweep(args, spec, wl, gen, timed, ks)
        res["throughput"] = throughput(args, spec, wl, timed, kmax, concs, tput_tokens)
        windows[:] = [w for w in windows if "-inject-" in w[0]]
        if spec["connector"] and not args.no_events:
            res["connector"] = connector_share(events(), windows)
            res["scheduler_host_us_median"] = med([e["host_us"] for e in events("scheduler")
                                                   if e.get("event") == "schedule"])
    res["duration_s"] = time.time() - t_all
    path = part_path(args, args.engine)
    with open(path + ".tmp", "w") as f:
        json.dump(res, f, indent=1)
    os.replace(path + ".tmp", path)
    log("engine %s done in %.0f s: %s" % (args.engine, res["duration_s"], path))
    return 0


def note(d, dt, o):
    """One timed request into its kind's lists: wall ms, first token, cached tokens and, of
    vLLM's request metrics, the engine core's scheduled -> first token and the queue."""
    d["ms"].append(dt * 1e3)
    d["first"].append(o.outputs[0].token_ids[0])
    d["cached"].append(getattr(o, "num_cached_tokens", None))
    m = getattr(o, "metrics", None)  # scheduled -> first token, in the engine core
    if m is not None and getattr(m, "first_token_ts", 0) and getattr(m, "scheduled_ts", 0):
        d["core_ms"].append((m.first_token_ts - m.scheduled_ts) * 1e3)
        d["queue_ms"].append((m.scheduled_ts - m.queued_ts) * 1e3)


def medians(d):
    d["median_ms"] = med(d["ms"])
    d["core_median_ms"] = med(d["core_ms"]) if d["core_ms"] else None
    d["queue_median_ms"] = med(d["queue_ms"]) if d["queue_ms"] else None


def ttft_sweep(args, spec, wl, gen, timed, ks):
    """TTFT at each k, the engine's kinds interleaved: {k: {kind: lists and medians}}."""
    out = {}
    for k in ks:
        if "apc" in spec["ttft"]:
            gen([wl.request("apc", k, wl.question("prime", k))])   # [header | facts | pad] cached
            log("TTFT k=%d: primed the prefix cache (%d prefix tokens)" % (k, wl.prefix_len(k)))
        for w in range(args.warmup):
            for kind in spec["ttft"]:
                gen([wl.request(kind, k, wl.question("warm", k, w))])
        row = {kind: {"ms": [], "first": [], "cached": [], "core_ms": [], "queue_ms": []}
               for kind in spec["ttft"]}
        for r in range(args.reps):
            q = wl.question("ttft", k, r)
            for kind in spec["ttft"]:
                dt, o = timed("ttft-%s-%d" % (kind, k), [wl.request(kind, k, q)])
                note(row[kind], dt, o[0])
        for d in row.values():
            medians(d)
        out[k] = row
        log("TTFT k=%d (%d prefix + %d question tokens): %s; num_cached_tokens %s" % (
            k, wl.prefix_len(k), wl.qlen, ", ".join("%s %.2f ms" % (kd, d["median_ms"]) for kd, d in row.items()),
            {kd: d["cached"][-1] for kd, d in row.items()}))
    return out


def throughput(args, spec, wl, timed, kmax, concs, tput_tokens):
    """Requests/s at the largest k, fresh questions every call: [row per (output tokens, concurrency)]."""
    out = []
    for n_out in tput_tokens:
        for n in concs:
            row = {"k": kmax, "concurrent": n, "output_tokens": n_out, "users": min(n, args.tput_users)}
            for kind in spec["tput"]:
                ts = []
                for rep in range(args.tput_reps + 1):
                    reqs = [wl.request(kind, kmax, wl.question("tput", n_out, n, rep, i), n_out,
                                       user=i % args.tput_users) for i in range(n)]
                    dt = timed("tput-%s-%d-%d" % (kind, n, n_out), reqs)[0]
                    if rep:
                        ts.append(dt)   # rep 0: the warm-up
                row[kind + "_rps"] = n / med(ts)
                row[kind + "_s_all"] = ts
            out.append(row)
            log("throughput k=%d, %d concurrent, %d output tokens: %s" % (
                kmax, n, n_out, ", ".join("%s %.1f req/s" % (kd, row[kd + "_rps"]) for kd in spec["tput"])))
    return out


def captured(outs):
    """Facts the requests' outcomes say were captured (kv_transfer_params' "captured"; a
    request that ends in the step of its capture has the result still pending: the capture
    requests ask for two tokens)."""
    from kvinject.vllm import PARAMS_KEY
    return sum(len(((o.kv_transfer_params or {}).get(PARAMS_KEY) or {}).get("captured") or []) for o in outs)


def capture(gen, events, wl, ks, res, users=1):
    """Header and every fact from one prefill; then each k's pad after [header | k facts];
    users 1 .. users - 1: header, facts and the largest k's pad from one prefill each.
    events: the worker's event records (a function), or None (no event file): the
    facts stored are then counted from the requests' outcomes."""
    import kvinject.vllm as kv
    kmax = max(ks)
    cp = kv.capture_prompt(TENANT, [kv.Keep(HEADER_ID, wl.header)]
                           + [kv.Keep(i, f) for i, f in zip(wl.fact_ids, wl.facts)] + [wl.question("capture")])
    outs = gen([(cp.prompt, cp.sampling_params(temperature=0.0, max_tokens=2, ignore_eos=True))])[1]
    pads = []
    for k in ks:
        if wl.pads[k]:
            segs = [seg for _, seg in wl.segments(k)[:-1]]
            pads.append(kv.capture_prompt(TENANT, segs + [kv.Keep(PAD_ID + k, wl.pads[k]), wl.question("pad", k)]))
    if pads:
        outs += gen([(p.prompt, p.sampling_params(temperature=0.0, max_tokens=2, ignore_eos=True)) for p in pads])[1]
    more = []
    for u in range(1, users):
        segs = [kv.Keep(i, seg) for i, seg in wl.segments(kmax, u)]
        more.append(kv.capture_prompt(TENANT + u, segs + [wl.question("capture", u)]))
    for i in range(0, len(more), 16):
        outs += gen([(p.prompt, p.sampling_params(temperature=0.0, max_tokens=2, ignore_eos=True)) for p in more[i:i + 16]])[1]
    want = kmax + 1 + len(pads) + (users - 1) * len(wl.segments(kmax))
    stored = (sum(e["stored"] for e in events() if e["event"] == "capture") if events is not None
              else captured(outs))
    if stored != want:
        raise SystemExit("vllm_bench: the captures stored %d facts, expected %d (header, %d facts, %d pads; "
                         "%d more users)" % (stored, want, kmax, len(pads), users - 1))
    reg = [e for e in events() if e["event"] == "register"] if events is not None else []
    res["register"] = reg[-1] if reg else None
    log("captured %d facts and %d pads; cache %s" % (kmax + 1, len(pads), res["register"] or "?"))


def cold_settings(args, cfg, wl, ks):
    """The cold engine's connector settings: a disk tier in a fresh directory under
    --out, hybrid serving, and a store memory of --cold-store-mb (default: 1.25 x
    the pages of one user's [header | facts | pad] at the largest k in the store's
    dtype, e.g. 102 pages of 2 MiB (255 MiB) for the 8B's fixed shape at k = 50;
    so memory holds about one user at the largest k, and capturing the next users
    pushes a user's facts out to disk)."""
    import shutil
    disk = os.path.join(args.out, "cold-disk-%s" % run_key(args))
    shutil.rmtree(disk, ignore_errors=True)
    os.makedirs(disk)
    mb = args.cold_store_mb
    if mb is None:
        mb = users_store_mb(args, cfg, wl, max(ks), 1)
    log("cold engine: disk tier %s, store memory %d MiB, hybrid (disk_read_mb_s %g, prefill_tokens_s %g)"
        % (disk, mb, args.cold_read_mb_s, args.cold_prefill_tokens_s))
    return dict(disk_dir=disk, hybrid=True, store_budget_mb=mb, disk_read_mb_s=args.cold_read_mb_s,
                prefill_tokens_s=args.cold_prefill_tokens_s)


def cold_capture(gen, events, wl, users, res):
    """Each cold user's [header | k facts | pad] from one prefill of its own, in order."""
    import kvinject.vllm as kv
    for tenant, k, rep in users:
        cp = kv.capture_prompt(tenant, [kv.Keep(fid, seg) for fid, seg in wl.segments(k)]
                               + [wl.question("cold-capture", k, rep)])
        gen([(cp.prompt, cp.sampling_params(temperature=0.0, max_tokens=1))])
    want = sum(len(wl.segments(k)) for _, k, _ in users)
    stored = sum(e["stored"] for e in events() if e["event"] == "capture")
    if stored != want:
        raise SystemExit("vllm_bench: the cold users' captures stored %d facts, expected %d" % (stored, want))
    reg = [e for e in events() if e["event"] == "register"]
    res["register"] = reg[-1] if reg else None
    log("cold engine: captured %d users (%d facts with headers and pads)" % (len(users), want))


def cold_users(args, gen, events, wl, ks, res):
    """The cold engine (see the docstring): every user captured first, then, in
    capture order, per user: re-prefill (the control), cold (its facts only on
    disk), settle (steps that bring the prefetch's report to the scheduler),
    warm (another question)."""
    import shutil
    import kvinject.vllm as kv
    users = [(COLD_TENANT + i, k, rep) for i, (k, rep) in
             enumerate((k, rep) for k in ks if k > 0 for rep in range(args.cold_reps))]
    cold_capture(gen, events, wl, users, res)

    def mem(tenant, k, q):
        mp = kv.memory_prompt(tenant, wl.segments(k), q)
        return mp.prompt, mp.sampling_params(temperature=0.0, max_tokens=1, skip_clone=True)

    reqs = []   # per timed request: kind, k, window, outcome (kv_transfer_params["kvinject"])
    out = {}
    for k in sorted({u[1] for u in users}):
        for w in range(args.warmup):
            gen([wl.request("prefill", k, wl.question("cold-warmup", k, w))])
        row = {kind: {"ms": [], "first": [], "cached": [], "core_ms": [], "queue_ms": []}
               for kind in ("reprefill", "cold", "warm")}
        for tenant, _, rep in [u for u in users if u[1] == k]:
            q = wl.question("cold", k, rep)
            control, cold = wl.request("prefill", k, q), mem(tenant, k, q)
            assert control[0] == cold[0], "the cold request's prompt is not its control's"
            warm = mem(tenant, k, wl.question("cold-warm", k, rep))
            for kind, r in (("reprefill", control), ("cold", cold), ("warm", warm)):
                if kind == "warm":
                    settle(args, gen, wl, tenant, k, rep)
                a = time.time()
                dt, o = gen([r])
                reqs.append({"kind": kind, "k": k, "t": (a, time.time()),
                             "outcome": (o[0].kv_transfer_params or {}).get("kvinject")})
                note(row[kind], dt, o[0])
        for d in row.values():
            medians(d)
        out[k] = dict(row, users=args.cold_reps, facts=len(wl.segments(k)))
    cold_outcomes(events, reqs, out)
    disk = res["cold_settings"]["disk_dir"]
    res["cold_disk_mb"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(disk) for f in fs) / 2**20
    shutil.rmtree(disk, ignore_errors=True)   # up to GiBs of tenant files
    res["cold"] = out


def settle(args, gen, wl, tenant, k, rep):
    """Between a cold user's cold and warm requests: twice a pause (the prefetch runs
    on the worker's thread, its reads on the store's) and a small plain request (a
    step whose report brings the prefetched facts' tiers to the scheduler); with
    --cold-settle-prefetch the first is a prefetch request of the user's tenant."""
    import kvinject.vllm as kv
    from vllm import SamplingParams
    for i in range(2):
        time.sleep(args.cold_settle_ms / 1e3)
        q = wl.question("settle", k, rep, i)
        if i == 0 and args.cold_settle_prefetch:
            pp = kv.prefetch_prompt(tenant, q[0])
            gen([(pp.prompt, pp.sampling_params(temperature=0.0, max_tokens=1, skip_clone=True))])
        else:
            gen([({"prompt_token_ids": q[:4]}, SamplingParams(temperature=0.0, max_tokens=1, skip_clone=True))])


def cold_outcomes(events, reqs, out):
    """Per kind and k: facts injected per request (the outcome's injected_facts; the
    worker's inject events in the request's time where the outcome is pending: one
    output token), the hybrid decisions the scheduler made meanwhile; logged."""
    inj = [e for e in events() if e["event"] == "inject"]
    sched = [e for e in events("scheduler") if e.get("event") == "schedule" and e.get("hybrid")]
    for r in reqs:
        a, b = r["t"]
        d = out[r["k"]][r["kind"]]
        oc = r["outcome"] or {}
        n = oc.get("injected_facts", 0)
        if oc.get("pending") or not oc:
            n = sum(e["facts"] for e in inj if a <= e["t"] <= b)
        d.setdefault("injected", []).append(n)
        d.setdefault("pending", []).append(bool(oc.get("pending")))
        h = d.setdefault("hybrid", {})
        for e in sched:
            if a <= e["t"] <= b:
                for dec, m in e["hybrid"].items():
                    h[dec] = h.get(dec, 0) + m
    for k, row in sorted(out.items()):
        row["cold_none"] = sum(n == 0 for n in row["cold"].get("injected", []))
        row["warm_all"] = sum(n == row["facts"] for n in row["warm"].get("injected", []))
        log("cold users k=%d (%d facts with header and pad): re-prefill %.2f ms, cold %.2f ms, warm %.2f ms; "
            "cold requests injecting nothing %d/%d, warm injecting all %d/%d; hybrid decisions cold %s, warm %s"
            % (k, row["facts"], row["reprefill"]["median_ms"], row["cold"]["median_ms"], row["warm"]["median_ms"],
               row["cold_none"], row["users"], row["warm_all"], row["users"], row["cold"].get("hybrid"),
               row["warm"].get("hybrid")))


def connector_share(ev, windows):
    ev = [e for e in ev if e["event"] == "inject"]
    share = {}
    for label, a, b in windows:
        inw = [e for e in ev if a <= e["t"] <= b + 0.05]
        s = share.setdefault(label, {"calls": 0, "wall_s": 0.0, "steps": 0, "host_us": [], "kvi_us": [],
                                     "device_us": [], "step_device_us": [], "requests": []})
        s["calls"] += 1
        s["wall_s"] += b - a
        s["steps"] += len(inw)
        for e in inw:
            for key in ("host_us", "kvi_us", "device_us", "step_device_us", "requests"):
                if key in e:
                    s[key].append(e[key])
    return [{"run": label, "calls": s["calls"], "inject_steps": s["steps"],
             "requests_per_step": med(s["requests"]), "host_us": med(s["host_us"]),
             "kvi_call_us": med(s["kvi_us"]), "device_us": med(s["device_us"]),
             "step_device_us": med(s["step_device_us"]),
             "host_share_of_wall": sum(s["host_us"]) * 1e-6 / s["wall_s"] if s["wall_s"] else float("nan"),
             "device_share_of_step": (sum(s["device_us"]) / sum(s["step_device_us"])
                                      if s["step_device_us"] else float("nan"))} for label, s in share.items()]


# ---------------------------------------------------------------- profiling

HOST_CATS = ("python_function", "cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def profile(args, spec, wl, gen, res, k):
    import torch
    from torch.profiler import ProfilerActivity, profile as tprofile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    if "apc" in spec["ttft"]:
        gen([wl.request("apc", k, wl.question("prime", k))])
    for w in range(args.warmup):
        for kind in spec["ttft"]:
            gen([wl.request(kind, k, wl.question("warm", k, w))])
    ms = {kind: [] for kind in spec["ttft"]}
    for r in range(args.reps):
        for kind in spec["ttft"]:
            ms[kind].append(gen([wl.request(kind, k, wl.question("ttft", k, r))])[0] * 1e3)
    res["profile"] = {"k": k, "prefix_tokens": wl.prefix_len(k), "kinds": {}}
    timers = {}
    if args.profile_timers:
        with HostTimers() as ht:
            for kind in spec["ttft"]:
                ht.reset()
                walls = [gen([wl.request(kind, k, wl.question("timers", k, i))])[0] * 1e3
                         for i in range(args.profile_timers)]
                timers[kind] = {"ttft_ms": med(walls), "rows": ht.rows(args.profile_timers)}
    for kind in spec["ttft"]:
        reqs = [wl.request(kind, k, wl.question("profile", k, i)) for i in range(args.profile_requests)]
        walls = []
        with tprofile(activities=acts, record_shapes=False, with_stack=args.profile_stack) as prof:
            for r in reqs:
                walls.append(gen([r])[0] * 1e3)
        base = os.path.join(args.profile, "%s-%s-k%d" % (args.engine, kind, k))
        prof.export_chrome_trace(base + ".trace.json")
        with open(base + ".trace.json", "rb") as fin, gzip.open(base + ".trace.json.gz", "wb") as fout:
            fout.writelines(fin)
        with open(base + ".trace.json") as f:
            summary = summarize_trace(json.load(f), len(reqs))
        os.remove(base + ".trace.json")
        with open(base + ".ops.txt", "w") as f:
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
        summary.update(ttft_ms=med(ms[kind]), profiled_wall_ms=med(walls), requests=len(reqs),
                       trace=os.path.basename(base) + ".trace.json.gz", timers=timers.get(kind))
        res["profile"]["kinds"][kind] = summary
        log("profile %s %s k=%d: TTFT %.2f ms in-process (unprofiled), %.2f ms profiled; device %.2f ms/request"
            % (args.engine, kind, k, summary["ttft_ms"], summary["profiled_wall_ms"], summary["device_ms"]))


#: (module, class or None for a module function, names): the host functions --profile-timers
#: times. Inclusive times: a timed function inside another counts in both.
HOST_TIMERS = [
    # the request's way in and out around the engine core (in this process when profiling)
    ("vllm.entrypoints.llm", "LLM", ["generate"]),
    ("vllm.v1.engine.llm_engine", "LLMEngine", ["add_request", "step"]),
    ("vllm.v1.engine.input_processor", "InputProcessor", ["process_inputs"]),
    ("vllm.v1.engine.output_processor", "OutputProcessor", ["add_request", "process_outputs"]),
    ("vllm.v1.engine.core", "EngineCore", ["add_request", "preprocess_add_request"]),
    ("vllm.v1.core.sched.scheduler", "Scheduler", ["add_request", "schedule", "update_from_output",
                                                   "_build_kv_connector_meta", "_update_after_schedule"]),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", ["execute_model", "sample_tokens", "_update_states",
                                                           "_prepare_inputs", "_model_forward", "_sample",
                                                           "_bookkeeping_sync"]),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", ["execute_model", "sample_tokens", "prepare_inputs"]),
    ("kvinject.vllm.connector", "KVInjectConnector",
     ["on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
      "update_connector_output", "request_finished", "bind_connector_metadata", "clear_connector_metadata",
      "start_load_kv", "wait_for_save", "get_finished", "get_block_ids_with_load_errors",
      "build_connector_worker_meta", "get_kv_connector_stats", "has_connector_metadata"]),
    ("kvinject.vllm.worker", "KVInjectWorker", ["_load", "_inject", "_request", "_start_prefetches",
                                                "_count_injections"]),
    ("kvinject.vllm.events", "Events", ["write"]),
    ("kvinject.transfer", "Injector", ["inject"]),
    ("kvinject.transfer", None, ["_request_array"]),
    ("kvinject._lib", "_Lib", ["call", "new"]),
    ("torch.cuda", None, ["current_stream"]),
]


class HostTimers:
    """Wraps HOST_TIMERS' functions with perf_counter (in this process: the engine core
    runs in it when profiling); totals per function name until reset()."""

    def __init__(self):
        self.t, self.undo, self.gc_t0 = {}, [], None

    def _gc(self, phase, info):
        """Python's garbage collections, per generation (gc.callbacks)."""
        if phase == "start":
            self.gc_t0 = time.perf_counter()
        elif self.gc_t0 is not None:
            e = self.t.setdefault("gc, generation %d" % info.get("generation", -1), [0, 0.0])
            e[0] += 1
            e[1] += time.perf_counter() - self.gc_t0
            self.gc_t0 = None

    def __enter__(self):
        import gc
        import importlib
        gc.callbacks.append(self._gc)
        for mod, cls, names in HOST_TIMERS:
            try:
                owner = importlib.import_module(mod)
                owner = getattr(owner, cls) if cls else owner
            except (ImportError, AttributeError):
                continue
            for name in names:
                fn = owner.__dict__.get(name) if cls else getattr(owner, name, None)
                if fn is None and cls:
                    fn = getattr(owner, name, None)   # inherited: wrapped on this class
                if fn is None or isinstance(fn, (staticmethod, classmethod, property)):
                    continue
                label = "%s.%s" % (cls or mod, name)
                self.undo.append((owner, name, owner.__dict__.get(name) if cls else fn, cls is not None))
                setattr(owner, name, self._wrap(fn, label))
        return self

    def _wrap(self, fn, label):
        acc = self.t
        pc = time.perf_counter

        def timed(*a, **kw):
            t0 = pc()
            try:
                return fn(*a, **kw)
            finally:
                e = acc.setdefault(label, [0, 0.0])
                e[0] += 1
                e[1] += pc() - t0
        return timed

    def __exit__(self, *exc):
        import gc
        gc.callbacks.remove(self._gc)
        for owner, name, orig, on_class in reversed(self.undo):
            if on_class and orig is None:
                delattr(owner, name)
            else:
                setattr(owner, name, orig)
        self.undo = []

    def reset(self):
        self.t.clear()

    def rows(self, n):
        return [{"name": k, "calls": v[0] / n, "us": v[1] / n * 1e6}
                for k, v in sorted(self.t.items(), key=lambda kv: -kv[1][1])]


def summarize_trace(trace, n, top=20):
    """Per request: host-side functions (Python frames, operators, CUDA runtime
    calls) with most self and inclusive time, summed over the threads that ran
    torch operators (inclusive time counts a recursive frame at every level),
    and device time (kernels, copies)."""
    evs = [e for e in (trace.get("traceEvents", trace) if isinstance(trace, dict) else trace)
           if e.get("ph") == "X" and "dur" in e]
    agg, dev, dev_total = {}, {}, 0.0
    threads = {}
    for e in evs:
        cat = e.get("cat", "")
        if cat in DEVICE_CATS:
            dev_total += e["dur"]
            dev[e["name"]] = dev.get(e["name"], 0.0) + e["dur"]
        elif cat in HOST_CATS:
            threads.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for es in threads.values():
        if not any(e.get("cat") in ("cpu_op", "cuda_runtime") for e in es):
            continue   # threads that ran no torch operator: idle waits (tqdm's monitor, pools)
        es.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []   # [end, agg entry]
        for e in es:
            end = e["ts"] + e["dur"]
            while stack and stack[-1][0] <= e["ts"]:
                stack.pop()
            a = agg.setdefault(e["name"], [0, 0.0, 0.0])   # calls, inclusive µs, self µs
            a[0] += 1
            a[1] += e["dur"]
            a[2] += e["dur"]
            if stack and end <= stack[-1][0] + 1e-3:
                stack[-1][1][2] -= e["dur"]
            stack.append([end, a])

    def rows(i):
        best = sorted(agg.items(), key=lambda kv: -kv[1][i])[:top]
        return [{"name": name[:160], "ms": v[i] / n / 1e3, "calls": v[0] / n} for name, v in best]
    return {"device_ms": dev_total / n / 1e3, "host_self": rows(2), "host_inclusive": rows(1),
            "kernels": [{"name": name[:120], "ms": t / n / 1e3} for name, t in
                        sorted(dev.items(), key=lambda kv: -kv[1])[:10]],
            "gaps": idle_gaps(evs, threads, n, top)}


def idle_gaps(evs, threads, n, top, min_us=50.0):
    """The GPU's idle time between its kernels and copies (gaps of at least
    min_us while requests run: between two requests the GPU idles by design, so
    gaps over 20 ms are left out), each gap given to what the host was doing
    at its middle: the innermost host event then, on the thread that ran torch
    operators, else "host idle or elsewhere". Per request, by host event."""
    gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in evs if e.get("cat", "") in DEVICE_CATS)
    host = sorted((e for es in threads.values() if any(x.get("cat") in ("cpu_op", "cuda_runtime") for x in es)
                   for e in es), key=lambda e: (e["ts"], -e["dur"]))
    starts = [e["ts"] for e in host]
    out, end = {}, None
    for a, b in gpu:
        if end is not None and min_us <= a - end <= 20000:
            mid = (a + end) / 2
            i = bisect.bisect_right(starts, mid)
            inner = None
            for e in reversed(host[max(0, i - 400):i]):   # the innermost event covering mid
                if e["ts"] <= mid <= e["ts"] + e["dur"]:
                    if inner is None or e["dur"] < inner["dur"]:
                        inner = e
            name = inner["name"][:160] if inner else "host idle or elsewhere"
            g = out.setdefault(name, [0, 0.0])
            g[0] += 1
            g[1] += a - end
        end = b if end is None else max(end, b)
    return [{"name": k, "ms": v[1] / n / 1e3, "gaps": v[0] / n}
            for k, v in sorted(out.items(), key=lambda kv: -kv[1][1])[:top]]


# ---------------------------------------------------------------- the driver

def drive(args):
    """Each engine of --engines in a subprocess (skipping those whose part is
    there), then the report. Exit 3: engines left for lack of time."""
    t0 = time.time()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # unwinds through the child's clean-up
    os.makedirs(args.out, exist_ok=True)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in ENGINES]
    if bad:
        raise SystemExit("vllm_bench: unknown engines %s" % bad)
    left, failed, took = [], [], []
    for rnd, e in [(r, e) for r in range(args.rounds) for e in engines]:
        path = part_path(args, e, rnd)
        e_label = e if args.rounds == 1 else "%s (round %d)" % (e, rnd + 1)
        if os.path.exists(path) and not args.redo:
            with open(path) as f:
                took.append(json.load(f).get("duration_s", 0))
            log("engine %s: its part is there (%s): not measured again (--redo measures)" % (e_label, path))
            continue
        remaining = args.time_budget - (time.time() - t0) if args.time_budget else None
        if remaining is not None and (remaining <= 30 or (took and max(took) > remaining)):
            log("engine %s: %.0f s left of the budget, the longest engine took %.0f s: run again to go on"
                % (e_label, remaining, max(took or [0])))
            left.append(e_label)
            continue
        wait_gpu_free()
        cmd = [sys.executable, os.path.abspath(__file__)] + sys.argv[1:] + ["--engine", e, "--child",
                                                                      "--round", str(rnd)]
        log("engine %s: %s" % (e_label, " ".join(cmd[1:])))
        t = time.time()
        p = subprocess.Popen(cmd, start_new_session=True)   # its own group: vLLM's engine core goes with it
        rc = None
        try:
            rc = p.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            pass
        finally:   # also when this process is stopped (SIGTERM from timeout): the group's processes first
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    break
                time.sleep(3)
            p.wait()
        took.append(time.time() - t)
        if rc is None and os.path.exists(path):
            log("engine %s: its part is written; stopped at the time budget while exiting" % e_label)
        elif rc is None:
            log("engine %s: stopped at the time budget after %.0f s" % (e_label, took[-1]))
            left.append(e_label)
        elif rc != 0 or not os.path.exists(path):
            log("engine %s: failed (exit %s) after %.0f s" % (e_label, rc, took[-1]))
            failed.append(e_label)
    if args.profile:
        write_profile_report(args)
    else:
        write_report(args, args.out)
    if failed:
        return 1
    return 3 if left else 0


# ---------------------------------------------------------------- the report

def load_runs(args, d, prefix="part"):
    """[(file name stem, {engine: part})] of the runs whose parts are in d: the
    run of these arguments (stem vllm_bench / profile), or, with --report and
    no --model, every run there (one: the same stems; several: stem-<key>)."""
    runs, key = {}, run_key(args) if args.model else None
    for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        if name.startswith(prefix + "-") and name.endswith(".json"):
            with open(os.path.join(d, name)) as f:
                p = json.load(f)
            if key is None or p.get("key") == key:
                runs.setdefault(p["key"], {}).setdefault(p["engine"], []).append(p)
    stem = "vllm_bench" if prefix == "part" else "profile"
    if not runs:
        log("no %s-*.json in %s for these arguments" % (prefix, d))
    return [(stem if len(runs) == 1 else "%s-%s" % (stem, k), {e: pool_rounds(ps) for e, ps in parts.items()})
            for k, parts in sorted(runs.items())]


def pool_rounds(parts):
    """One engine's parts of a run, one per round, as one part: each TTFT kind's
    requests in round order with their medians over all of them; the other
    figures (throughput, the connector's share, the engine's start) round 1's;
    "rounds": every round's part as it was."""
    parts = sorted(parts, key=lambda p: p.get("round", 0))
    if len(parts) == 1:
        return parts[0]
    out = json.loads(json.dumps(parts[0]))   # a deep copy
    for k, kinds in out.get("ttft", {}).items():
        for kind, d in kinds.items():
            for p in parts[1:]:
                more = p.get("ttft", {}).get(k, {}).get(kind) or {}
                for field in ("ms", "first", "cached", "core_ms", "queue_ms"):
                    d[field] = d.get(field, []) + more.get(field, [])
            medians(d)
    out["rounds"] = parts
    return out


def paired_verdict(intervals):
    """True: every interval's high bound <= TARGET_FLOOR; False: some low bound above
    it; None: neither, or one missing."""
    if not intervals or None in intervals:
        return None
    if any(lo > TARGET_FLOOR for _, lo, _ in intervals):
        return False
    return True if all(hi <= TARGET_FLOOR for _, _, hi in intervals) else None


def shared_md(m):
    """The shared engine's table: injected and APC requests of the same prompt in one
    engine (the connector loaded, vLLM's prefix cache on), each round's ratio."""
    rounds = m.get("shared_rounds") or []
    L = ["", "In one engine (the connector with vLLM's prefix cache on: the APC requests are the injected "
         "requests' prompts without the kvinject parameters, [header | facts | pad] cached first):", "",
         "| k | APC ms | injected ms | injected / APC | paired: median [95% interval] | per round | core ms: APC, "
         "injected | rest ms: APC, injected | first tokens agree |", "|--:|--:|--:|--:|---|---|---|---|--:|"]
    for r in m["ttft"]:
        rest = [None if x is None or y is None else x - y
                for x, y in ((r["shared_apc_ms"], r["shared_apc_core_ms"]),
                             (r["shared_inject_ms"], r["shared_inject_core_ms"]))]
        per = ", ".join(fmt(x["inject_over_apc"].get(str(r["k"])), "%.3f") for x in rounds) or "—"
        pr = r.get("shared_paired")
        paired = "%.3f [%.3f, %.3f]" % tuple(pr) if pr else "—"
        L.append("| %d | %s | %s | %s | %s | %s | %s, %s | %s, %s | %s |" % (
            r["k"], fmt(r["shared_apc_ms"]), fmt(r["shared_inject_ms"]), fmt(r["shared_inject_over_apc"], "%.3f"),
            paired, per, fmt(r["shared_apc_core_ms"]), fmt(r["shared_inject_core_ms"]), fmt(rest[0]), fmt(rest[1]),
            r["shared_agree"]))
    v = m.get("targets", {}).get("shared_paired_all_k")
    L += ["", "In one engine, injected / APC <= %.2f at every k by the paired ratios' intervals: %s" % (
        TARGET_FLOOR, {True: "met", False: "NOT met (an interval lies above it)"}.get(v, "undecided (an interval "
                                                                                       "spans it, or none)"))]
    return L


def fmt(x, f="%.2f"):
    return "—" if x is None or x != x else f % x


def write_report(args, d):
    for stem, parts in load_runs(args, d):
        write_run_report(d, stem, parts)


def write_run_report(d, stem, parts):
    any_part = next(iter(parts.values()))
    a = any_part["args"]
    c, ap, pl = parts.get("connector"), parts.get("apc"), parts.get("plain")

    def ttft(part, kind, k):   # parts come from JSON: keys are strings
        row = (part or {}).get("ttft", {}).get(str(k))
        return row.get(kind) if row else None

    def ms(part, kind, k):
        r = ttft(part, kind, k)
        return r["median_ms"] if r else None

    def ratio(x, y):
        return x / y if x is not None and y else None

    def core(part, kind, k):  # scheduled -> first token in the engine core (parts before it: None)
        r = ttft(part, kind, k)
        return r.get("core_median_ms") if r else None

    def agree(p1, k1, p2, k2, k):
        r1, r2 = ttft(p1, k1, k), ttft(p2, k2, k)
        if not r1 or not r2:
            return "—"
        return "%d/%d" % (sum(x == y for x, y in zip(r1["first"], r2["first"])), min(len(r1["first"]),
                                                                                      len(r2["first"])))
    ks = sorted(int(k) for k in any_part["prefix_tokens"])
    rows, floor_ok, plain_ok = [], [], []
    for k in ks:
        r = {"k": k, "prefix_tokens": any_part["prefix_tokens"][str(k)], "pad": any_part["pads"][str(k)],
             "prefill_ms": ms(c, "prefill", k), "inject_ms": ms(c, "inject", k), "apc_ms": ms(ap, "apc", k),
             "plain_ms": ms(pl, "prefill", k)}
        r["inject_over_apc"] = ratio(r["inject_ms"], r["apc_ms"])
        for key, part, kind in (("prefill", c, "prefill"), ("inject", c, "inject"), ("apc", ap, "apc")):
            row = ttft(part, kind, k)
            r[key + "_iqr"] = quartiles(row["ms"]) if row else None
        r.update(prefill_core_ms=core(c, "prefill", k), inject_core_ms=core(c, "inject", k),
                 apc_core_ms=core(ap, "apc", k), plain_core_ms=core(pl, "prefill", k))
        r["inject_over_apc_core"] = ratio(r["inject_core_ms"], r["apc_core_ms"])
        r["prefill_over_plain"] = ratio(r["prefill_ms"], r["plain_ms"])
        r["inject_change"] = ratio(r["inject_ms"], r["prefill_ms"])
        r["inject_change"] = None if r["inject_change"] is None else r["inject_change"] - 1
        apc_row = ttft(ap, "apc", k)
        r["apc_cached"] = min(x for x in apc_row["cached"] if x is not None) \
            if apc_row and any(x is not None for x in apc_row["cached"]) else None
        r["agree_inject"] = agree(c, "inject", c, "prefill", k)
        r["agree_apc"] = agree(ap, "apc", c, "prefill", k)
        if r["inject_over_apc"] is not None:
            floor_ok.append(r["inject_over_apc"] <= TARGET_FLOOR)
        if r["prefill_over_plain"] is not None:
            plain_ok.append(r["prefill_over_plain"] <= TARGET_FLOOR)
        rows.append(r)
    sh = parts.get("shared")   # injected and APC in one engine (the connector, prefix caching on)
    for r in rows:
        k = r["k"]
        r.update(shared_apc_ms=ms(sh, "apc", k), shared_inject_ms=ms(sh, "inject", k),
                 shared_apc_core_ms=core(sh, "apc", k), shared_inject_core_ms=core(sh, "inject", k))
        r["shared_inject_over_apc"] = ratio(r["shared_inject_ms"], r["shared_apc_ms"])
        a_row, i_row = ttft(sh, "apc", k), ttft(sh, "inject", k)
        r["shared_paired"] = paired_ratio(a_row["ms"], i_row["ms"]) if a_row and i_row else None
        r["shared_agree"] = agree(sh, "inject", sh, "apc", k)
    by_round = []   # each round's injected / APC at each k (--rounds: the engines ran in turn)
    for i, (cr, ar) in enumerate(zip((c or {}).get("rounds", []), (ap or {}).get("rounds", []))):
        by_round.append({"round": i + 1, "inject_over_apc": {
            str(k): ratio(ms(cr, "inject", k), ms(ar, "apc", k)) for k in ks}})
    shared_rounds = [{"round": i + 1, "inject_over_apc": {str(k): ratio(ms(sr, "inject", k), ms(sr, "apc", k))
                                                          for k in ks}}
                     for i, sr in enumerate((sh or {}).get("rounds", []))]
    tput = []
    for i, row in enumerate((c or ap or {}).get("throughput", [])):
        t = dict(k=row["k"], concurrent=row["concurrent"], output_tokens=row["output_tokens"],
                 users=row.get("users", 1), prefill_rps=row.get("prefill_rps"), inject_rps=row.get("inject_rps"))
        if ap and c:
            m = [x for x in ap.get("throughput", []) if x["concurrent"] == row["concurrent"]
                 and x["output_tokens"] == row["output_tokens"]]
            t["apc_rps"] = m[0]["apc_rps"] if m else None
        else:
            t["apc_rps"] = row.get("apc_rps")
        t["inject_over_prefill"] = ratio(t["inject_rps"], t["prefill_rps"])
        t["inject_over_apc"] = ratio(t["inject_rps"], t["apc_rps"])
        tput.append(t)
    merged = {"args": a, "versions": any_part.get("versions"), "engines": {
        e: {k: p.get(k) for k in ("engine_start_s", "engine_config", "memory", "duration_s", "register",
                                  "scheduler_host_us_median")} for e, p in parts.items()},
        "ttft": rows, "rounds": by_round, "shared_rounds": shared_rounds, "throughput": tput, "connector": (c or {}).get("connector", []),
        "targets": {"inject_over_apc_all_k": all(floor_ok) if len(floor_ok) == len(ks) else None,
                    # in one engine, by the paired ratios: met where the interval lies at or below
                    # the target, not met where it lies above, else undecided (None)
                    "shared_paired_all_k": paired_verdict([r.get("shared_paired") for r in rows]),
                    "prefill_over_plain_all_k": all(plain_ok) if len(plain_ok) == len(ks) else None}}
    cp = parts.get("cold")
    merged["cold"] = cold_rows(cp)
    if cp:
        merged["cold_engine"] = {"settings": cp.get("cold_settings"), "disk_mb": cp.get("cold_disk_mb")}
    cr = [r["cold_over_reprefill"] for r in merged["cold"]]
    merged["targets"]["cold_over_reprefill_all_k"] = (all(x <= TARGET_FLOOR for x in cr)
                                                      if cr and None not in cr else None)
    hi = [t for t in tput if t["concurrent"] == max(x["concurrent"] for x in tput)] if tput else []
    merged["targets"]["tput_all"] = (all((t["inject_over_prefill"] or 0) >= TARGET_TPUT for t in hi)
                                     if hi and c else None)
    with open(os.path.join(d, stem + ".json"), "w") as f:
        json.dump(merged, f, indent=1)
    md = report_md(merged, sorted(parts))
    with open(os.path.join(d, stem + ".md"), "w") as f:
        f.write(md)
    print(md, flush=True)
    plot_ttft(merged, os.path.join(d, stem + ".png"))
    plot_ttft_order(parts, ks, merged.get("versions") or {}, os.path.join(d, stem + "-order.png"))


def cold_rows(part):
    """The cold engine's rows of the merged report, per k ([] without its part)."""
    def ratio(x, y):
        return x / y if x is not None and y else None
    rows = []
    for k, r in sorted((int(k), r) for k, r in ((part or {}).get("cold") or {}).items()):
        rp, cd, wm = r["reprefill"], r["cold"], r["warm"]
        row = {"k": k, "prefix_tokens": part["prefix_tokens"][str(k)], "facts": r["facts"], "users": r["users"],
               "reprefill_ms": rp["median_ms"], "cold_ms": cd["median_ms"], "warm_ms": wm["median_ms"],
               "reprefill_core_ms": rp["core_median_ms"], "cold_core_ms": cd["core_median_ms"],
               "warm_core_ms": wm["core_median_ms"], "cold_none": r["cold_none"], "warm_all": r["warm_all"],
               "cold_hybrid": cd.get("hybrid") or {}, "warm_hybrid": wm.get("hybrid") or {},
               "agree_cold": "%d/%d" % (sum(x == y for x, y in zip(cd["first"], rp["first"])), len(cd["first"]))}
        row["cold_over_reprefill"] = ratio(row["cold_ms"], row["reprefill_ms"])
        row["warm_over_reprefill"] = ratio(row["warm_ms"], row["reprefill_ms"])
        rows.append(row)
    return rows


def cold_md(m):
    """The cold engine's table (report_md)."""
    ce = m.get("cold_engine") or {}
    st = ce.get("settings") or {}

    def dec(h):
        return ", ".join("%s %d" % (d, h[d]) for d in ("inject", "await", "text") if d in h) or "—"
    L = ["", "Cold users (engine cold: the connector with a disk tier and hybrid serving, store memory %s MiB, "
         "disk_read_mb_s %s, prefill_tokens_s %s; %s MiB of tenant files): each user's [header | facts | pad] "
         "captured, then per user in capture order its prompt re-prefilled without memory (the control), the "
         "same prompt with its facts only on disk (cold: the connector's hybrid plan), and after the prefetch "
         "another question (warm). Medians over the users of each k; the engine core's scheduled to first "
         "token beside; the scheduler's hybrid decisions (facts) of the cold and warm requests:" % (
             st.get("store_budget_mb"), fmt(st.get("disk_read_mb_s"), "%g"), fmt(st.get("prefill_tokens_s"), "%g"),
             fmt(ce.get("disk_mb"), "%.0f")), "",
         "| k | prefix tokens (facts) | re-prefill ms | cold ms | cold / re-prefill | warm ms | warm / re-prefill | "
         "cold requests with 0 facts injected | warm requests with all injected | first tokens agree (cold vs "
         "re-prefill) | core ms: re-prefill, cold, warm | hybrid decisions: cold; warm |",
         "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|"]
    for r in m["cold"]:
        L.append("| %d | %d (%d) | %s | %s | %s | %s | %s | %d/%d | %d/%d | %s | %s, %s, %s | %s; %s |" % (
            r["k"], r["prefix_tokens"], r["facts"], fmt(r["reprefill_ms"]), fmt(r["cold_ms"]),
            fmt(r["cold_over_reprefill"], "%.3f"), fmt(r["warm_ms"]), fmt(r["warm_over_reprefill"], "%.3f"),
            r["cold_none"], r["users"], r["warm_all"], r["users"], r["agree_cold"], fmt(r["reprefill_core_ms"]),
            fmt(r["cold_core_ms"]), fmt(r["warm_core_ms"]), dec(r["cold_hybrid"]), dec(r["warm_hybrid"])))
    return L


def plot_ttft(m, path):
    """TTFT against k for each path measured (a PNG beside the table), where matplotlib is."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("no matplotlib here: no plot (vllm_bench.py --report DIR where it is)")
        return
    rows = m["ttft"]
    ks = [r["k"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for key, label in (("prefill_ms", "re-prefill (connector loaded)"), ("plain_ms", "re-prefill, no connector"),
                       ("apc_ms", "vLLM prefix cache, prefix cached (floor)"), ("inject_ms", "injected"),
                       ("shared_apc_ms", "one engine: vLLM prefix cache"), ("shared_inject_ms", "one engine: injected")):
        pts = [(k, r[key]) for k, r in zip(ks, rows) if r.get(key) is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    v = m.get("versions") or {}
    ax.set_title("vLLM %s, %s: TTFT, one request at a time" % (v.get("vllm"), v.get("gpu")), fontsize=9)
    ax.set_xlabel("facts in the prompt (k)")
    ax.set_ylabel("TTFT, median ms")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log("plot: %s" % path)


def plot_ttft_order(parts, ks, v, path):
    """Each timed request's TTFT in the order it was measured, one panel per k: the
    engines ran one after the other, so a slow phase of the machine shows here as a
    step in one engine's line and not in the other's (a PNG beside the table)."""
    c, ap, sh = parts.get("connector"), parts.get("apc"), parts.get("shared")
    series = [(c, "prefill", "re-prefill"), (ap, "apc", "APC, prefix cached"), (c, "inject", "injected"),
              (sh, "apc", "one engine: APC"), (sh, "inject", "one engine: injected")]
    ks = [k for k in ks if any(((p or {}).get("ttft", {}).get(str(k)) or {}).get(kind) for p, kind, _ in series)]
    if not ks:
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, len(ks), figsize=(2.2 * len(ks) + 1, 3.2), squeeze=False)
    top = 0.0
    for ax, k in zip(axes[0], ks):
        for p, kind, label in series:
            row = ((p or {}).get("ttft", {}).get(str(k)) or {}).get(kind)
            if row and row.get("ms"):
                ax.plot(range(1, len(row["ms"]) + 1), row["ms"], marker=".", linewidth=1, label=label)
                top = max(top, max(row["ms"]))
        ax.set_title("k = %d" % k, fontsize=9)
        ax.set_xlabel("request, in order", fontsize=8)
    for ax in axes[0]:
        ax.set_ylim(0, top * 1.05)
    axes[0][0].set_ylabel("TTFT ms")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle("vLLM %s, %s: each request's TTFT in measurement order (engines run one after the other)"
                 % (v.get("vllm"), v.get("gpu")), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log("plot: %s" % path)


def report_md(m, engines):
    a, v = m["args"], m["versions"] or {}
    flo, fhi = lists(argparse.Namespace(**a))[3]
    facts = ("%d tokens" % flo) if flo == fhi else ("%d-%d tokens (drawn per fact)" % (flo, fhi))
    L = ["## vLLM %s: the kvinject connector against re-prefill and vLLM's prefix cache (%s)" % (
        v.get("vllm"), v.get("gpu")), "",
         "model %s; shape %s: %d-token header, k facts of %s, %d-token question; block %d (%s); store %s; "
         "TTFT median of %s, throughput median of %d; engines measured: %s" % (
             os.path.basename(a["model"].rstrip("/")), a["shape"], a["header_tokens"], facts, a["question_tokens"],
             a["block_size"], "no pad" if a["no_align"] else "prefix padded to whole blocks", a["store_dtype"],
             "%d (%d rounds of %d)" % (a["reps"] * len(m["rounds"]), len(m["rounds"]), a["reps"])
             if m.get("rounds") else a["reps"], a["tput_reps"], ", ".join(engines)), ""]
    for e, info in m["engines"].items():
        mem = info.get("memory") or {}
        L.append("- %s: start %s s, run %s s; %s; gpu_memory_utilization %s, KV cache ~%s GiB" % (
            e, fmt(info.get("engine_start_s"), "%.0f"), fmt(info.get("duration_s"), "%.0f"), info.get("engine_config"),
            mem.get("gpu_mem"), fmt(mem.get("kv_cache_gib"), "%.1f")))
    main = any(r[x] is not None for r in m["ttft"] for x in ("prefill_ms", "plain_ms", "apc_ms", "inject_ms"))
    if main:   # the connector, apc and plain engines' table (not with the cold engine's part alone)
        L += ["", "| k | prefix tokens (pad) | APC cached | re-prefill ms | re-prefill, no connector ms | APC ms | "
              "injected ms | injected / APC | re-prefill / no connector | injected vs re-prefill | first tokens "
              "agree (inject, APC vs re-prefill) |", "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in m["ttft"] if main else []:
        L.append("| %d | %d (%s) | %s | %s | %s | %s | %s | %s | %s | %s | %s, %s |" % (
            r["k"], r["prefix_tokens"], r["pad"], fmt(r["apc_cached"], "%d"), fmt(r["prefill_ms"]),
            fmt(r["plain_ms"]), fmt(r["apc_ms"]), fmt(r["inject_ms"]), fmt(r["inject_over_apc"], "%.3f"),
            fmt(r["prefill_over_plain"], "%.3f"), fmt(None if r["inject_change"] is None else r["inject_change"] * 100,
                                                      "%+.0f%%"), r["agree_inject"], r["agree_apc"]))
    if main and any(r.get("apc_iqr") or r.get("inject_iqr") for r in m["ttft"]):
        L += ["", "Spread of the requests behind each median (25th to 75th percentile, ms): a ratio of medians "
              "means little where these ranges are wide or apart from run to run", "",
              "| k | re-prefill | APC | injected |", "|--:|--:|--:|--:|"]
        for r in m["ttft"]:
            L.append("| %d | %s | %s | %s |" % (r["k"], *["—" if not r.get(x) else "%.2f–%.2f" % tuple(r[x])
                                                           for x in ("prefill_iqr", "apc_iqr", "inject_iqr")]))
    if m.get("rounds"):
        L += ["", "Each round's injected / APC (the connector and apc engines ran in turn, %d rounds of --reps "
              "requests each; the tables above pool the rounds' requests):" % len(m["rounds"]), "",
              "| k | " + " | ".join("round %d" % r["round"] for r in m["rounds"]) + " |",
              "|--:|" + "--:|" * len(m["rounds"])]
        for r in m["ttft"]:
            L.append("| %d | %s |" % (r["k"], " | ".join(fmt(x["inject_over_apc"].get(str(r["k"])), "%.3f")
                                                       for x in m["rounds"])))
    if any(r.get("inject_core_ms") is not None or r.get("apc_core_ms") is not None for r in m["ttft"]):
        L += ["", "Inside the engine core (vLLM's request metrics: scheduled to first token), and the rest of the "
              "TTFT above (input processing, the engine's queue and IPC, output):", "",
              "| k | re-prefill core ms | no connector core ms | APC core ms | injected core ms | injected / APC "
              "(core) | APC rest ms | injected rest ms |", "|--:|--:|--:|--:|--:|--:|--:|--:|"]
        for r in m["ttft"]:
            rest = [None if x is None or y is None else x - y
                    for x, y in ((r["apc_ms"], r["apc_core_ms"]), (r["inject_ms"], r["inject_core_ms"]))]
            L.append("| %d | %s | %s | %s | %s | %s | %s | %s |" % (
                r["k"], fmt(r["prefill_core_ms"]), fmt(r["plain_core_ms"]), fmt(r["apc_core_ms"]),
                fmt(r["inject_core_ms"]), fmt(r["inject_over_apc_core"], "%.3f"), fmt(rest[0]), fmt(rest[1])))
    if any(r.get("shared_inject_ms") is not None for r in m["ttft"]):
        L += shared_md(m)
    if m.get("cold"):
        L += cold_md(m)
    if m["throughput"]:
        L += ["", "| k | concurrent | users | output tokens | re-prefill req/s | APC req/s | injected req/s | "
              "injected / re-prefill | injected / APC |", "|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
        for t in m["throughput"]:
            L.append("| %d | %d | %d | %d | %s | %s | %s | %s | %s |" % (
                t["k"], t["concurrent"], t.get("users", 1), t["output_tokens"], fmt(t["prefill_rps"], "%.1f"),
                fmt(t["apc_rps"], "%.1f"),
                fmt(t["inject_rps"], "%.1f"), fmt(t["inject_over_prefill"], "%.2fx"),
                fmt(t["inject_over_apc"], "%.2fx")))
    if m["connector"]:
        L += ["", "| run | inject steps | req/step | connector host µs | kvi_inject call µs | injection device µs | "
              "step device µs | host share of wall | injection share of step |",
              "|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
        for s in m["connector"]:
            L.append("| %s | %d | %s | %s | %s | %s | %s | %s | %s |" % (
                s["run"], s["inject_steps"], fmt(s["requests_per_step"], "%g"), fmt(s["host_us"], "%.0f"),
                fmt(s["kvi_call_us"], "%.0f"), fmt(s["device_us"], "%.0f"), fmt(s["step_device_us"], "%.0f"),
                fmt(s["host_share_of_wall"] * 100, "%.1f%%"), fmt(s["device_share_of_step"] * 100, "%.1f%%")))

    def verdict(x):
        return "not measured" if x is None else ("met" if x else "NOT met")
    tg = m["targets"]
    L += ["", "targets: injected TTFT <= %.2f x APC at every k: %s; re-prefill with the connector loaded <= %.2f x "
          "without at every k: %s; injected >= %gx re-prefill's requests/s at the highest concurrency (k = %s, each "
          "output length): %s" % (TARGET_FLOOR, verdict(tg["inject_over_apc_all_k"]), TARGET_FLOOR,
                                  verdict(tg["prefill_over_plain_all_k"]), TARGET_TPUT,
                                  m["throughput"][0]["k"] if m["throughput"] else "—", verdict(tg["tput_all"])),
          "", "target: a cold user's first request (facts only on disk) <= %.2f x the re-prefill of its prompt at "
          "every k: %s" % (TARGET_FLOOR, verdict(tg.get("cold_over_reprefill_all_k"))), ""]
    return "\n".join(L)


def write_profile_report(args):
    for stem, parts in load_runs(args, args.profile, "profile"):
        write_profile_run(args.profile, stem, parts)


def write_profile_run(d, stem, parts):
    stack = any((p.get("args") or {}).get("profile_stack") for p in parts.values())
    L = ["## Profiles (engine core in-process; torch.profiler, Python stacks %s)" % ("on" if stack else "off"), ""]
    for e, p in sorted(parts.items()):
        pr = p["profile"]
        for kind, s in pr["kinds"].items():
            L += ["### %s engine, %s, k = %d (%d prefix tokens): TTFT %.2f ms in-process, %.2f ms profiled; "
                  "device %.2f ms per request; %s" % (e, kind, pr["k"], pr["prefix_tokens"], s["ttft_ms"],
                                                      s["profiled_wall_ms"], s["device_ms"], s["trace"]), "",
                  "| host, self ms / request | calls | function |", "|--:|--:|---|"]
            L += ["| %.3f | %g | %s |" % (r["ms"], r["calls"], r["name"].replace("|", "/")) for r in s["host_self"]]
            L += ["", "| host, inclusive ms / request | calls | function |", "|--:|--:|---|"]
            L += ["| %.3f | %g | %s |" % (r["ms"], r["calls"], r["name"].replace("|", "/"))
                  for r in s["host_inclusive"]]
            L += ["", "| device ms / request | kernel |", "|--:|---|"]
            L += ["| %.3f | %s |" % (r["ms"], r["name"].replace("|", "/")) for r in s["kernels"]] + [""]
            if s.get("gaps"):
                L += ["| GPU idle ms / request | gaps | what the host was doing |", "|--:|--:|---|"]
                L += ["| %.3f | %g | %s |" % (r["ms"], r["gaps"], r["name"].replace("|", "/"))
                      for r in s["gaps"]] + [""]
            if s.get("timers"):
                tm = s["timers"]
                L += ["Host timers (--profile-timers, unprofiled requests: TTFT %.2f ms): inclusive µs per "
                      "request" % tm["ttft_ms"], "", "| µs / request | calls | function |", "|--:|--:|---|"]
                L += ["| %.1f | %g | %s |" % (r["us"], r["calls"], r["name"]) for r in tm["rows"]] + [""]
    with open(os.path.join(d, stem + ".md"), "w") as f:
        f.write("\n".join(L))
    log("profile summary: %s" % os.path.join(d, stem + ".md"))


def main():
    args = parse_args()
    if args.report:
        args.out = args.report
        if args.profile:
            write_profile_report(args)
        else:
            write_report(args, args.report)
        return 0
    if args.engine == "all":
        return drive(args)
    rc = run_engine(args)
    if not args.child:
        if args.profile:
            write_profile_report(args)
        else:
            write_report(args, args.out)
    return rc


if __name__ == "__main__":
    sys.exit(main())
