"""kvinject.vllm's request parameters without vLLM: the prompt helpers' spans and
parse_params' checks (every refusal names its problem)."""
from __future__ import annotations

import sys

import pytest

from kvi_testutil import case
from kvinject.vllm import PARAMS_KEY, Keep, capture_prompt, memory_prompt, notes_capture_prompts, parse_params


class TestPrompts:
    def test_memory_prompt_spans(self):
        mp = memory_prompt(7, [(100, [1, 2, 3]), (5, [4, 5]), (6, 3)], [9, 9], filler_token=0)
        assert mp.prompt_token_ids == [1, 2, 3, 4, 5, 0, 0, 0, 9, 9]
        assert mp.params == {"tenant": 7, "inject": [[100, 0, 3], [5, 3, 2], [6, 5, 3]]}
        assert mp.kv_transfer_params == {PARAMS_KEY: mp.params}
        assert mp.extra_args() == {"kv_transfer_params": {PARAMS_KEY: mp.params}}
        spec = parse_params(mp.params, len(mp.prompt_token_ids))
        assert spec.claim_end == 8
        assert [(s.fact_id, s.start, s.length) for s in spec.inject] == [(100, 0, 3), (5, 3, 2), (6, 5, 3)]
        with pytest.raises(ValueError, match="filler_token"):
            memory_prompt(1, [(1, 3)], [1])
        with pytest.raises(ValueError, match="question: no tokens"):
            memory_prompt(1, [(1, [2])], [])

    def test_capture_prompt_spans(self):
        cp = capture_prompt(3, [[1, 1], Keep(8, [2, 2, 2], embedding=[0.5, 1]), [3], Keep(9, [4], replace=True)])
        assert cp.prompt_token_ids == [1, 1, 2, 2, 2, 3, 4]
        assert cp.params["capture"] == [{"fact_id": 8, "start": 2, "length": 3, "embedding": [0.5, 1.0]},
                                        {"fact_id": 9, "start": 6, "length": 1, "replace": True}]
        with pytest.raises(ValueError, match="capture\\[1\\]: the store keeps embeddings of 2"):
            parse_params(cp.params, 7, embedding_dim=2)
        spec = parse_params({"tenant": 3, "capture": cp.params["capture"][1:]}, 7)
        assert (spec.capture_end, spec.claim_end, spec.capture[0].replace) == (7, 0, True)

    def test_notes_capture_prompts(self):
        hdr, facts = [1, 1], [Keep(10, [2, 2]), Keep(11, [3]), Keep(12, [4, 4, 4], embedding=[1.0])]
        (one,) = notes_capture_prompts(5, hdr, facts)  # every fact after all the earlier ones: one prompt
        assert one.prompt_token_ids == [1, 1, 2, 2, 3, 4, 4, 4]
        assert one.params == {"tenant": 5, "capture": [
            {"fact_id": 10, "start": 2, "length": 2}, {"fact_id": 11, "start": 4, "length": 1},
            {"fact_id": 12, "start": 5, "length": 3, "embedding": [1.0]}]}
        # a memory prompt of the same facts in the same order holds each fact where it was captured
        mp = memory_prompt(5, [(99, hdr)] + [(f.fact_id, f.tokens) for f in facts], [7])
        assert mp.prompt_token_ids[:-1] == one.prompt_token_ids
        assert [s[1:] for s in mp.params["inject"][1:]] == [[c["start"], c["length"]]
                                                            for c in one.params["capture"]]
        w1 = notes_capture_prompts(5, hdr, facts, window=1, tail=[9])
        assert [p.prompt_token_ids for p in w1] == [[1, 1, 2, 2, 9], [1, 1, 2, 2, 3, 9], [1, 1, 3, 4, 4, 4, 9]]
        assert [p.params["capture"][0]["start"] for p in w1] == [2, 4, 3]
        assert len(notes_capture_prompts(5, hdr, facts, window=0)[2].prompt_token_ids) == 5
        kept = notes_capture_prompts(5, Keep(99, hdr), facts, window=1)  # the header captured once, first
        assert [[c["fact_id"] for c in p.params["capture"]] for p in kept] == [[99, 10], [11], [12]]
        assert kept[0].params["capture"][0] == {"fact_id": 99, "start": 0, "length": 2}
        for bad, msg in [(dict(window=-1), "window"), (dict(window=1.5), "window"), (dict(window=True), "window")]:
            with pytest.raises(ValueError, match=msg):
                notes_capture_prompts(5, hdr, facts, **bad)
        with pytest.raises(TypeError, match="facts\\[0\\]: a Keep"):
            notes_capture_prompts(5, hdr, [(10, [2])])
        with pytest.raises(ValueError, match="facts: none"):
            notes_capture_prompts(5, hdr, [])
        with pytest.raises(ValueError, match="header: no tokens"):
            notes_capture_prompts(5, [], facts)

    def test_refusals_name_the_problem(self):
        good = {"tenant": 1, "inject": [[1, 0, 2], [2, 2, 3]]}
        parse_params(good, 6)
        cases = [
            ("a list", [1], "must be a dict"),
            ("no tenant", {"inject": [[1, 0, 2]]}, "need a tenant"),
            ("tenant as text", {"tenant": "a", "inject": [[1, 0, 2]]}, "tenant must be an integer"),
            ("tenant too big", {"tenant": 1 << 64, "inject": [[1, 0, 2]]}, "out of range"),
            ("unknown key", dict(good, positions=[0]), "unknown kvinject parameters \\['positions'\\]"),
            ("a gap", {"tenant": 1, "inject": [[1, 0, 2], [2, 3, 1]]}, "inject\\[1\\] starts at token 3"),
            ("not from 0", {"tenant": 1, "inject": [[1, 1, 2]]}, "back to back from token 0"),
            ("a zero length", {"tenant": 1, "inject": [[1, 0, 0]]}, "length = 0 is out of range"),
            ("a pair", {"tenant": 1, "inject": [[1, 0]]}, "must be \\[fact_id, start, length\\]"),
            ("filling the prompt", good, "at least one prompt token"),
            ("nothing asked", {"tenant": 1}, "ask for nothing"),
            ("a capture past the prompt", {"tenant": 1, "capture": [{"fact_id": 1, "start": 4, "length": 2}]},
             "spans tokens 4..5 of a 5-token prompt"),
            ("a fact captured twice", {"tenant": 1, "capture": [{"fact_id": 1, "start": 0, "length": 1},
                                                                 {"fact_id": 1, "start": 1, "length": 1}]},
             "captured twice"),
            ("an embedding for a store without", {"tenant": 1, "capture": [{"fact_id": 1, "start": 0, "length": 1,
                                                                             "embedding": [1.0]}]}, "keeps none"),
        ]
        for name, params, msg in cases:
            with case(name):
                with pytest.raises(ValueError, match=msg):
                    parse_params(params, 5)


if __name__ == "__main__":
    from kvi_testutil import run_pytest
    sys.exit(run_pytest(__file__, sys.argv[1:]))
