"""kvinject.vllm's request parameters without vLLM: the prompt helpers' spans and
parse_params' checks (every refusal names its problem)."""
from __future__ import annotations

import sys

import pytest

from kvi_testutil import case
from kvinject.vllm import (PARAMS_KEY, RESULT_TOKENS, Keep, capture_prompt, memory_prompt, notes_capture_prompts,
                           parse_params, remove_prompt)


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



class TestRemove:
    def test_remove_prompt_is_one_token_and_its_parameters(self):
        rp = remove_prompt(7, [3, 1, 2], 42)
        assert rp.prompt_token_ids == [42]
        assert rp.params == {"tenant": 7, "remove": [3, 1, 2]}
        spec = parse_params(rp.params, 1)
        assert (spec.tenant, spec.remove, spec.remove_all, spec.inject, spec.capture) == (7, [3, 1, 2], False, [], [])
        every = remove_prompt(7, "all", 0)
        assert every.params == {"tenant": 7, "remove": "all"}
        spec = parse_params(every.params, 1)
        assert (spec.remove, spec.remove_all) == (None, True)
        assert RESULT_TOKENS == 2

    def test_keep_dependents(self):
        rp = remove_prompt(7, [3], 42, keep_dependents=True)
        assert rp.params == {"tenant": 7, "remove": [3], "keep_dependents": True}
        assert parse_params(rp.params, 1).keep_dependents is True
        assert parse_params(remove_prompt(7, [3], 42).params, 1).keep_dependents is False
        with pytest.raises(ValueError, match="keep_dependents without remove"):
            parse_params({"tenant": 1, "keep_dependents": True, "capture": [{"fact_id": 5, "start": 0, "length": 2}]}, 3)
        with pytest.raises(ValueError, match="keep_dependents must be true or false"):
            parse_params({"tenant": 1, "remove": [1], "keep_dependents": 1}, 3)

    def test_a_captures_context_is_the_spans_before_it(self):
        spec = parse_params({"tenant": 1, "inject": [[0, 0, 2], [4, 2, 3]],
                             "capture": [{"fact_id": 9, "start": 8, "length": 2}, {"fact_id": 7, "start": 5, "length": 3},
                                         {"fact_id": 8, "start": 6, "length": 1}]}, 11)
        assert [spec.context_of(c) for c in spec.capture] == [[0, 4, 7, 8], [0, 4], [0, 4]]
        # a fact injected, then captured again after it: not its own context
        spec = parse_params({"tenant": 1, "inject": [[4, 0, 2]],
                             "capture": [{"fact_id": 4, "start": 2, "length": 2, "replace": True}]}, 5)
        assert spec.context_of(spec.capture[0]) == []

    def test_remove_prompt_refusals(self):
        for name, args, msg in [
            ("no ids", (7, [], 1), "fact_ids is empty"),
            ("a string", (7, "every", 1), 'a list of fact ids or "all"'),
            ("a repeated id", (7, [1, 2, 1], 1), "fact_ids\[2\]: fact 1 is named twice"),
            ("a negative id", (7, [-1], 1), "fact_ids\[0\] = -1 is out of range"),
            ("a token id of text", (7, [1], "a"), "token_id must be a token id"),
            ("a negative token id", (7, [1], -3), "token_id must be a token id"),
        ]:
            with case(name):
                with pytest.raises(ValueError, match=msg):
                    remove_prompt(*args)

    def test_remove_with_capture_and_inject(self):
        # removal runs first: a request may remove a fact and capture it anew
        spec = parse_params({"tenant": 1, "remove": [5], "capture": [{"fact_id": 5, "start": 0, "length": 2}]}, 3)
        assert spec.remove == [5] and [c.fact_id for c in spec.capture] == [5]
        spec = parse_params({"tenant": 1, "remove": [9], "inject": [[5, 0, 2]]}, 3)
        assert spec.remove == [9] and spec.claim_end == 2

    def test_remove_refusals_name_the_problem(self):
        for name, params, msg in [
            ("empty", {"tenant": 1, "remove": []}, "remove is empty"),
            ("a dict", {"tenant": 1, "remove": {"ids": [1]}}, 'a list of fact ids or "all"'),
            ("text", {"tenant": 1, "remove": "1,2"}, 'a list of fact ids or "all"'),
            ("a float", {"tenant": 1, "remove": [1.5]}, "remove\[0\] must be an integer"),
            ("a bool", {"tenant": 1, "remove": [True]}, "remove\[0\] must be an integer"),
            ("too big", {"tenant": 1, "remove": [1 << 64]}, "remove\[0\] = .* out of range"),
            ("twice", {"tenant": 1, "remove": [4, 4]}, "remove\[1\]: fact 4 is named twice"),
            ("an injected fact", {"tenant": 1, "remove": [5], "inject": [[5, 0, 2]]},
             "remove names fact 5, which the request injects"),
            ("all with inject", {"tenant": 1, "remove": "all", "inject": [[5, 0, 2]]}, 'remove "all" with inject'),
            ("no tenant", {"remove": [1]}, "need a tenant"),
        ]:
            with case(name):
                with pytest.raises(ValueError, match=msg):
                    parse_params(params, 3)


if __name__ == "__main__":
    from kvi_testutil import run_pytest
    sys.exit(run_pytest(__file__, sys.argv[1:]))
