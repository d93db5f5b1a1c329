"""The connector's scheduler side without an engine: vLLM's own Request objects
(with its block hasher) and scheduler outputs built by hand, for the paths
test_connector.py cannot reach on demand: a local prefix-cache hit before the
claim (a preempted request resumed on its own cached blocks), a capture whose
prompt is prefilled over two steps (chunked prefill), and the salt's effect on
block hashes.

    launch.py test_scheduler.py

(test_vllm_scheduler_unit.py tests the same role on fakes of these objects,
without vLLM.)
"""
from __future__ import annotations

import types

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from kvinject.vllm import capture_prompt, Keep, memory_prompt
from kvinject.vllm.connector import KVInjectConnector
from kvinject.vllm.metadata import KVInjectMetadata

BS = 4


def config():
    ktc = types.SimpleNamespace(kv_connector_extra_config={}, is_kv_producer=True)
    return types.SimpleNamespace(kv_transfer_config=ktc, cache_config=types.SimpleNamespace(block_size=BS))


init_none_hash(sha256_cbor)
HASHER = get_request_block_hasher(BS, sha256_cbor)


def request(rid, mp=None, ids=None):
    sp = mp.sampling_params(max_tokens=1) if mp is not None else SamplingParams(max_tokens=1)
    return Request(request_id=rid, prompt_token_ids=list(ids if ids is not None else mp.prompt_token_ids),
                   sampling_params=sp, pooling_params=None, block_hasher=HASHER)


def new_req(req, blocks, computed):
    return types.SimpleNamespace(req_id=req.request_id, block_ids=(list(blocks),), num_computed_tokens=computed)


def output(new=(), cached=None, scheduled=None):
    cached = cached or types.SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                             num_computed_tokens=[])
    return types.SimpleNamespace(scheduled_new_reqs=list(new), scheduled_cached_reqs=cached,
                                 num_scheduled_tokens=dict(scheduled or {}))


@pytest.fixture
def connector():
    return KVInjectConnector(config(), KVConnectorRole.SCHEDULER, None)


@pytest.fixture
def mp():
    # facts of 3, 5 and 2 tokens, then a 3-token question
    return memory_prompt(9, [(1, [11, 12, 13]), (2, [21, 22, 23, 24, 25]), (3, [31, 32])], [41, 42, 43])


def test_salt_changes_the_block_hashes_and_is_unique(connector, mp):
    plain = request("p", ids=mp.prompt_token_ids)
    a, b = request("a", mp), request("b", mp)
    assert a.block_hashes == plain.block_hashes  # same tokens, no salt yet
    connector.on_new_request(a)
    connector.on_new_request(b)
    assert a.cache_salt and a.cache_salt != b.cache_salt
    assert len(a.block_hashes) == len(plain.block_hashes)
    assert not set(a.block_hashes) & set(plain.block_hashes)
    assert not set(a.block_hashes) & set(b.block_hashes)
    connector.on_new_request(plain)  # no kvinject parameters: untouched
    assert plain.cache_salt is None


def test_blocks_hashed_after_the_salt_chain_on_it(connector, mp):
    # output tokens that fill two more blocks: hashed by vLLM's own hasher on
    # the salted parents, never the plain request's hashes of the same tokens
    plain, a = request("p", ids=mp.prompt_token_ids), request("a", mp)
    connector.on_new_request(a)
    n = len(a.block_hashes)
    assert n == len(mp.prompt_token_ids) // BS and all(isinstance(h, bytes) for h in a.block_hashes)
    for r in (plain, a):
        r.append_output_token_ids([7] * (2 * BS))
    assert len(a.block_hashes) == len(plain.block_hashes) == n + 2
    assert not set(a.block_hashes) & set(plain.block_hashes)
    # a prompt shorter than a block: nothing to salt yet; vLLM puts the salt in its first block's hash
    short_mp = memory_prompt(9, [(1, [11, 12])], [41])
    s, p2 = request("s", short_mp), request("p2", ids=short_mp.prompt_token_ids)
    connector.on_new_request(s)
    assert s.block_hashes == [] and s.cache_salt
    for r in (s, p2):
        r.append_output_token_ids([7] * BS)
    assert len(s.block_hashes) == len(p2.block_hashes) == 1 and s.block_hashes != p2.block_hashes


def test_claim_after_a_local_hit_injects_the_facts_past_it(connector, mp):
    r = request("r", mp)
    connector.on_new_request(r)
    assert connector.get_num_new_matched_tokens(r, 0) == (10, False)
    # resumed on its own cached blocks: 4 tokens (one block) already computed
    assert connector.get_num_new_matched_tokens(r, 4) == (6, False)
    connector.update_state_after_alloc(r, None, 6)
    meta = connector.build_connector_meta(output([new_req(r, [7, 8, 9, 5], 10)], scheduled={"r": 3}))
    (job,) = meta.injects
    # fact 1 (tokens 0..2) lies in the cached block; fact 2 (3..7) straddles it and is written whole
    assert job.facts == [(2, 3, 5), (3, 8, 2)]
    assert job.block_ids == [7, 8, 9, 5]
    assert connector.get_num_new_matched_tokens(r, 10) == (0, False)
    assert connector.build_connector_meta(output()).injects == []


def test_capture_waits_for_the_whole_span_over_chunked_steps(connector):
    cp = capture_prompt(9, [[1, 2, 3], Keep(5, [4, 5, 6, 7, 8]), [9]])
    r = request("c", cp)
    connector.on_new_request(r)
    assert connector.get_num_new_matched_tokens(r, 0) == (0, False)
    connector.update_state_after_alloc(r, None, 0)
    m1 = connector.build_connector_meta(output([new_req(r, [3, 4], 0)], scheduled={"c": 6}))
    assert m1.captures == []  # tokens 0..5 computed; the span ends at 8
    cached = types.SimpleNamespace(req_ids=["c"], new_block_ids=[([6],)], resumed_req_ids=set(),
                                   num_computed_tokens=[6])
    m2 = connector.build_connector_meta(output(cached=cached, scheduled={"c": 3}))
    (job,) = m2.captures
    assert (job.tenant, job.captures, job.block_ids) == (9, [(5, 3, 5, None, False)], [3, 4, 6])
    m3 = connector.build_connector_meta(output(cached=types.SimpleNamespace(
        req_ids=["c"], new_block_ids=[None], resumed_req_ids=set(), num_computed_tokens=[9]), scheduled={"c": 1}))
    assert m3.captures == []  # once


def test_layerwise_injection_asks_vllm_for_piecewise_cuda_graphs():
    # vLLM calls this on the connector class before capturing graphs; the
    # per-layer hook must stay outside them, injection before the forward may not
    assert KVInjectConnector.requires_piecewise_for_cudagraph({"layerwise": True})
    assert not KVInjectConnector.requires_piecewise_for_cudagraph({"layerwise": False})
    assert not KVInjectConnector.requires_piecewise_for_cudagraph({})
    assert not KVInjectConnector.requires_piecewise_for_cudagraph(None)


def test_vllms_per_layer_hooks_run_only_while_layers_are_pending():
    # vLLM's wrapper around each attention layer calls wait_for_layer_load and
    # save_kv_layer only where has_connector_metadata() is true; the step's
    # bound metadata stays readable for start_load_kv and wait_for_save
    from kvinject.vllm import _compat
    w = KVInjectConnector(config(), KVConnectorRole.WORKER, None)
    assert not w.has_connector_metadata() and _compat.bound_metadata(w) is None
    m = KVInjectMetadata()
    w.bind_connector_metadata(m)
    assert not w.has_connector_metadata() and _compat.bound_metadata(w) is m
    w.connector_worker._pending = [("job", "request")]  # a layer-by-layer injection under way
    assert w.has_connector_metadata()
    w.connector_worker._pending = []
    w.clear_connector_metadata()
    assert _compat.bound_metadata(w) is None
    s = KVInjectConnector(config(), KVConnectorRole.SCHEDULER, None)
    assert not s.has_connector_metadata()


def test_settings_are_checked():
    cfg = config()
    cfg.kv_transfer_config.kv_connector_extra_config = {"time_device": True, "layerwise": True}
    KVInjectConnector(cfg, KVConnectorRole.SCHEDULER, None)
    cfg.kv_transfer_config.kv_connector_extra_config = {"time_devices": True}
    with pytest.raises(ValueError, match=r"unknown key\(s\) time_devices in kv_connector_extra_config"):
        KVInjectConnector(cfg, KVConnectorRole.SCHEDULER, None)


def test_a_bad_request_claims_one_token_and_is_reported_with_its_blocks(connector):
    bad = memory_prompt(9, [(1, [11, 12])], [41])
    del bad.params["tenant"]
    r = request("x", bad)
    connector.on_new_request(r)
    assert r.cache_salt
    assert connector.get_num_new_matched_tokens(r, 0) == (1, False)
    meta = connector.build_connector_meta(output([new_req(r, [2], 1)], scheduled={"x": 2}))
    (f,) = meta.failures
    assert (f.req_id, f.block_ids) == ("x", [2])
    assert "need a tenant" in f.message
    assert meta.injects == []
