"""Plain vLLM (no connector, no prefix caching): greedy tokens and logprobs of
every full prompt of the scenario (common.Scenario.baseline_prompts), each
alone in the engine, and of the 8 full prompts of the tenants' batch in one
batch; written as JSON to the path given. The reference for test_connector.py.

    launch.py baseline.py OUT.json
"""
import json
import sys
import time

import common as C


def main(out_path):
    t0 = time.time()
    import vllm
    llm = vllm.LLM(enable_prefix_caching=False, **C.ENGINE)
    sc = C.Scenario(llm.get_tokenizer())
    prompts = sc.baseline_prompts()
    names = sorted(prompts)
    res = {n: C.record(llm.generate([{"prompt_token_ids": prompts[n]}], C.sampling(vllm), use_tqdm=False)[0])
           for n in names}
    outs = llm.generate([{"prompt_token_ids": sc.full_prompt(t, q)} for t, q in sc.batch8()], C.sampling(vllm),
                        use_tqdm=False)
    with open(out_path, "w") as f:
        json.dump({"outputs": res, "batch8": [C.record(o) for o in outs], "prompts": prompts}, f)
    C.log("baseline: %d prompts in %.0f s; t1_q0: %r" % (len(names), time.time() - t0, res["t1_q0"]["text"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
