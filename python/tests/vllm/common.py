"""What the vLLM tests share: the model, the engine settings, the conversations
(as token ids, tokenized segment by segment so that every fact is a span of
whole tokens) and the comparisons of outputs.

Run through launch.py (the vLLM virtual environment), by pytest. One engine
per module (a module-scoped fixture): its start-up is most of the time.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time

# Reproducible numerics: vLLM's CPU attention splits a sequence's KV across
# threads by default, so its reduction order follows the batch; and an
# in-process engine core takes every request of a generate() call into its
# first step (a separate core process starts on the first one alone). Batch
# composition still changes the decode steps' numerics (seen: a request alone
# and in a batch of 9 differ from the second token on), so references are
# computed in the same batches.
os.environ.setdefault("VLLM_CPU_ATTN_SPLIT_KV", "0")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = os.environ.get("KVI_VLLM_MODEL", "/var/cache/kvinject/vllm/model/SmolLM2-135M-Instruct")
BLOCK_SIZE = 32          # a multiple of 32 (CPU_ATTN); small, so short prompts fill blocks
MAX_TOKENS = 12          # greedy tokens compared per request
LOGPROBS = 20            # top logprobs per step (vLLM's default maximum)

ENGINE = dict(model=MODEL, enforce_eager=True, max_model_len=1024, block_size=BLOCK_SIZE, dtype="bfloat16",
              seed=0, max_num_seqs=64, max_num_batched_tokens=4096)

HEADER = ("<|im_start|>system\nYou are a helpful assistant. You remember what the user told you."
          "<|im_end|>\n<|im_start|>user\n")

# four tenants, the same fact ids (1, 2, 3), different contents
TENANT_FACTS = {
    1: ["My name is Alice. ", "I live in Lisbon, near the river. ", "My cat is called Tom. "],
    2: ["My name is Bruno. ", "I live in Oslo, by the fjord. ", "My dog is called Rex. "],
    3: ["My name is Chen. ", "I live in Kyoto, in the hills. ", "My parrot is called Kiwi. "],
    4: ["My name is Dana. ", "I live in Quito, up high. ", "My horse is called Star. "],
}
QUESTIONS = ["What is my pet called?<|im_end|>\n<|im_start|>assistant\n",
             "Where do I live?<|im_end|>\n<|im_start|>assistant\n"]
HEADER_ID = 100
FACT_IDS = [1, 2, 3]

# other conversations, in which tenant 5 (tenant 1's facts) says its facts
# (shifted: other context before each fact, other positions)
SHIFTED = [
    ["We talked about the weather yesterday; it rained all day. ", (1,), "Thanks for listening. "],
    ["I have a question about cooking pasta. How long should it boil? Anyway, ", (2,),
     "and that is all for today. "],
    [(3,), "He sleeps all day on the sofa. "],
]

# an isolation prompt whose facts appear nowhere else
ISO_FACTS = ["My brother plays the violin in an orchestra. ", "We meet every Sunday for lunch at noon. ",
             "Our favourite dish is a fish soup. "]
ISO_IDS = [201, 202, 203]
ISO_QUESTION = "What does my brother play?<|im_end|>\n<|im_start|>assistant\n"

ZERO_TENANT, WRONG_ROPE_TENANT, HF_TENANT = 99, 98, 97
WRONG_ROPE_SHIFT = 7     # keys rotated this many positions past where they are


class Scenario:
    """Token ids of every segment (tokenizer of the model)."""

    def __init__(self, tokenizer):
        enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
        self.header = enc(HEADER)
        self.facts = {t: [enc(f) for f in fs] for t, fs in TENANT_FACTS.items()}
        self.questions = [enc(q) for q in QUESTIONS]
        self.iso_facts = [enc(f) for f in ISO_FACTS]
        self.iso_question = enc(ISO_QUESTION)
        self.shifted = [[enc(s) if isinstance(s, str) else s for s in conv] for conv in SHIFTED]

    def full_prompt(self, tenant, q):
        ids = list(self.header)
        for f in self.facts[tenant]:
            ids += f
        return ids + self.questions[q]

    def iso_prompt(self):
        ids = list(self.header)
        for f in self.iso_facts:
            ids += f
        return ids + self.iso_question

    def batch8(self):
        """The (tenant, question) pairs of the 8-request batch, in order."""
        return [(t, q) for t in TENANT_FACTS for q in range(len(QUESTIONS))]

    def baseline_prompts(self):
        """name -> token ids: every full prompt the tests compare with."""
        out = {"t%d_q%d" % (t, q): self.full_prompt(t, q) for t in TENANT_FACTS for q in range(len(QUESTIONS))}
        out["iso"] = self.iso_prompt()
        return out


def sampling(llm_module, n=MAX_TOKENS, **kw):
    return llm_module.SamplingParams(temperature=0.0, max_tokens=n, logprobs=LOGPROBS, **kw)


def generate(llm, vllm_module, prompts, n=MAX_TOKENS):
    """[prompt ids or MemoryPrompt] -> records, in one generate call (one batch):
    greedy, n tokens, LOGPROBS top logprobs per step."""
    ps, sps = [], []
    for p in prompts:
        if isinstance(p, list):
            ps.append({"prompt_token_ids": p})
            sps.append(sampling(vllm_module, n))
        else:
            ps.append(p.prompt)
            sps.append(p.sampling_params(temperature=0.0, max_tokens=n, logprobs=LOGPROBS))
    return [record(o) for o in llm.generate(ps, sps, use_tqdm=False)]


def record(out):
    """A RequestOutput as plain data: tokens, per-step {token: logprob}, cached tokens, finish reason."""
    c = out.outputs[0]
    steps = []
    for d in (c.logprobs or []):
        steps.append({int(t): float(lp.logprob) for t, lp in d.items()})
    return {"tokens": list(c.token_ids), "logprobs": steps, "cached": out.num_cached_tokens,
            "finish": c.finish_reason, "text": c.text}


def chosen_logprobs(rec):
    return [steps[t] for t, steps in zip(rec["tokens"], rec["logprobs"])]


def top_kl(ref_step, test_step):
    """KL(ref || test) over ref's top tokens (renormalized there); a token missing
    from test's top list gets test's smallest listed logprob (an upper bound of
    its probability, so the KL is a lower bound)."""
    floor = min(test_step.values())
    ps = {t: math.exp(lp) for t, lp in ref_step.items()}
    z = sum(ps.values())
    qs = {t: math.exp(test_step.get(t, floor)) for t in ref_step}
    zq = sum(qs.values())
    return sum(p / z * math.log((p / z) / (qs[t] / zq)) for t, p in ps.items() if p > 0)


def agreement(ref, test):
    """Leading greedy tokens equal, of the reference's."""
    n = 0
    for a, b in zip(ref["tokens"], test["tokens"]):
        if a != b:
            break
        n += 1
    return n


class Engine:
    """A vLLM engine with the connector (prefix caching on), its event files
    at ``events_path``, and what the tests do with it."""

    def __init__(self, events_path, **connector):
        import vllm
        from kvinject.vllm import kv_transfer_config
        self.vllm = vllm
        self.events_path = events_path
        for suffix in (".worker0.jsonl", ".scheduler.jsonl"):
            if os.path.exists(events_path + suffix):
                os.remove(events_path + suffix)
        t0 = time.time()
        self.llm = vllm.LLM(enable_prefix_caching=True,
                            kv_transfer_config=kv_transfer_config(events_path=events_path, **connector), **ENGINE)
        log("engine with the connector up in %.0f s" % (time.time() - t0))

    def run(self, prompts, n=MAX_TOKENS):
        """generate() of the prompts in one batch (records)."""
        return generate(self.llm, self.vllm, prompts, n)

    def worker_events(self, kind=None):
        return [e for e in events(self.events_path + ".worker0.jsonl") if kind is None or e["event"] == kind]

    def scheduler_events(self, kind=None):
        return [e for e in events(self.events_path + ".scheduler.jsonl") if kind is None or e["event"] == kind]


def load_json(path):
    with open(path) as f:
        return json.load(f)


def events(path):
    out = []
    if os.path.exists(path):
        with open(path) as f:
            out = [json.loads(line) for line in f if line.strip()]
    return out


def log(*a):
    print(*a, flush=True)
    sys.stdout.flush()
