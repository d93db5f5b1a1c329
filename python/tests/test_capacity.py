"""kvinject_bench.capacity (docs/capacity.md): its arithmetic against values
computed by hand from the formulas (page bytes of include/kvinject/store.h,
users per node, the break-even, Zipf shares), and its command line. Needs
only Python.
"""
from __future__ import annotations

import json
import math

import pytest

from kvinject_bench import capacity as cap

M8 = cap.INPUTS["models"]["llama-8b"]
M70 = cap.INPUTS["models"]["llama-70b"]


def test_page_bytes_by_hand():
    # bf16: 32 layers x K,V x 8 heads x 16 tokens x 128 x 2 bytes
    assert cap.page_bytes(M8, "bf16", 16) == 2_097_152
    assert cap.bf16_token_bytes(M8) == 131_072  # 128 KiB
    assert cap.bf16_token_bytes(M70) == 327_680
    # fp8: 1,048,576 element bytes + 32 x 2 x 8 fp32 scales + 32 x 8 x 128 fp16 key offsets
    assert cap.page_bytes(M8, "fp8", 16) == 1_048_576 + 2_048 + 65_536
    # q4, 64-token pages: codes 4,194,304 / 2, words 32 x 8 x (128 + 64) x 4
    assert cap.page_bytes(M8, "q4", 64) == 2_097_152 + 196_608
    # store.h: 140 / 512 of bf16 at 64-token pages, 0.320 at 16
    assert cap.page_bytes(M8, "q4", 64) / 64 / 131_072 == 140 / 512
    assert cap.page_bytes(M8, "q4", 16) == 524_288 + 147_456
    assert round(cap.page_bytes(M8, "q4", 16) / 16 / 131_072, 4) == 0.3203
    with pytest.raises(ValueError):
        cap.page_bytes(M8, "fp16x", 16)


def test_odd_geometry_alignment():
    odd = {"layers": 1, "kv_heads": 1, "head_size": 6}
    # fp8: 1 x 2 x 1 x 3 x 6 = 36 element bytes -> 48, then 1 x 2 x 1 x 4 = 8 scale bytes -> 16,
    # then 1 x 1 x 6 x 2 = 12 key offset bytes -> 16
    assert cap.page_bytes(odd, "fp8", 3) == 48 + 16 + 16
    # q4: 18 code bytes -> 32, then 1 x 1 x (6 + 3) x 4 = 36 -> 48
    assert cap.page_bytes(odd, "q4", 3) == 32 + 48


def test_page_bytes_match_the_library(closing):
    """page_bytes against kvi_store_stats.page_bytes of a CPU store of each model and layout
    (and the odd geometry above): the model's page is the library's, byte for byte."""
    try:
        import kvinject as kvi
    except ImportError as e:
        pytest.skip("no libkvinject to compare with: %s" % e)
    dtypes = {"bf16": kvi.DType.BF16, "fp8": kvi.DType.FP8_E4M3, "q4": kvi.DType.Q4}
    odd = {"layers": 1, "kv_heads": 1, "head_size": 6}
    cases = [(m, dtype, P) for m in (M8, M70) for dtype, P in cap.INPUTS["layouts"]]
    cases += [(odd, "fp8", 3), (odd, "q4", 3), (odd, "bf16", 3)]
    for m, dtype, P in cases:
        want = cap.page_bytes(m, dtype, P)
        model = kvi.Model(m["layers"], m["kv_heads"], m["head_size"])
        closing.append(model)
        store = kvi.Store(model, want, backend=kvi.Backend.CPU, dtype=dtypes[dtype], page_tokens=P)
        closing.append(store)
        st = store.stats()
        assert (st.page_bytes, st.pages_total) == (want, 1), (m, dtype, P)
    # the example of CHANGELOG.md: a 24-token fact in 16-token fp8 pages, 2,180 KiB, 0.532 of bf16
    assert 2 * cap.page_bytes(M8, "fp8", 16) == 2_180 * 1024
    assert round(cap.page_bytes(M8, "fp8", 16) / cap.page_bytes(M8, "bf16", 16), 3) == 0.532


def test_fact_and_user_bytes():
    # a 20-token fact takes two 16-token pages in memory, its 20 tokens on disk
    assert cap.fact_bytes(M8, "bf16", 16, 20) == (2 * 2_097_152, 20 * 131_072)
    # fp8 on disk: 20 tokens x 65,536 + 2 pages x (2,048 scale bytes + 65,536 key offset bytes)
    assert cap.fact_bytes(M8, "fp8", 16, 20)[1] == 20 * 65_536 + 2 * (2_048 + 65_536)
    # q4, 64-token pages: one page in memory; on disk 20 x 32,768 + one page's words
    assert cap.fact_bytes(M8, "q4", 64, 20) == (2_293_760, 20 * 32_768 + 196_608)
    # a file keeps an fp8 page's scales and key offsets back to back, unpadded (store-format.md):
    # odd geometry, 4 tokens in 3-token pages: 1 x 2 x 1 x 4 x 6 element bytes, then 2 pages x
    # (8 scale bytes + 12 key offset bytes); in memory 2 pages of 48 + 16 + 16
    odd = {"layers": 1, "kv_heads": 1, "head_size": 6}
    assert cap.fact_bytes(odd, "fp8", 3, 4) == (2 * 80, 48 + 2 * (8 + 12))
    inp = cap.load_inputs()[0]
    assert cap.user_bytes(inp, M8, "bf16", 16) == (200 * 4_194_304, 200 * 2_621_440)


def test_users_per_node_by_hand():
    inp = cap.load_inputs()[0]
    up = cap.users_per_node(inp, M8, "bf16", 16)
    assert up["device"] == int(8 * 40e9 // 838_860_800) == 381
    assert up["host"] == int(1536e9 // 838_860_800) == 1831
    assert up["disk"] == int(27e12 // 524_288_000) == 51_498


def test_request_and_break_even_by_hand():
    inp = cap.load_inputs()[0]
    rc = cap.request_cost(inp, M8, "bf16", 16)
    rate = 33.5 * 1264
    assert rc["tokens"] == 1000
    assert math.isclose(rc["t_prefill"], 1000 / rate)
    inject_bps = 150 * 2**20 / 0.119e-3
    t_inj = 1000 * 131_072 / inject_bps
    assert math.isclose(rc["t_device"], t_inj)
    t_host = 50 * 4_194_304 / 47.1e9 + t_inj
    assert math.isclose(rc["t_host"], t_host)
    t_disk = 0.1e-3 + 50 * 2_621_440 / 25e9 + t_host
    assert math.isclose(rc["t_disk"], t_disk)
    assert math.isclose(rc["t_hybrid"], t_disk * rc["t_prefill"] / (t_disk + rc["t_prefill"]))
    be = cap.break_even(inp, M8, "bf16", 16)
    saved = (1000 / rate - t_inj) * 3.5 / 3600
    assert math.isclose(be["usd_saved_per_request"], saved)
    assert math.isclose(be["requests_per_hour"]["device"], 0.8388608 * 3.5 / 141 / saved)
    assert math.isclose(be["requests_per_hour"]["host"], 0.8388608 * 0.0002 / saved)
    assert math.isclose(be["requests_per_hour"]["disk"], 0.524288 * 0.000005 / saved)
    assert round(be["requests_per_hour"]["device"]) == 911
    # 70B: the params-scaled rate on 8 GPUs
    rc70 = cap.request_cost(inp, M70, "bf16", 16)
    assert math.isclose(rc70["t_prefill"], 1000 / (rate * 8.03 / 70.6 * 8))


def test_zipf():
    # H(10, 1) = 7381 / 2520
    assert math.isclose(cap.harmonic(10, 1.0), 7381 / 2520)
    # the Euler-Maclaurin tail against the exact sum
    for s in (0.8, 1.0, 1.2):
        exact = math.fsum(i ** -s for i in range(1, 100_001))
        assert math.isclose(cap.harmonic(100_000, s, exact_upto=100), exact, rel_tol=1e-9)
    assert math.isclose(cap.harmonic(10**6, 1.0), 14.392726722865723, rel_tol=1e-12)
    assert math.isclose(cap.zipf_top(1, 10, 1.0), 2520 / 7381)
    assert cap.zipf_top(0, 10, 1.0) == 0.0 and cap.zipf_top(10, 10, 1.0) == 1.0
    # one visit request in four pays its tier: device 3/4 + 1/4 x 2520/7381
    h = cap.placement_hits(10, 1, 2, 1.0, 4)
    assert math.isclose(h["device"], 0.75 + 0.25 * 2520 / 7381)
    assert math.isclose(h["host"], 0.25 * (1 + 1 / 2 + 1 / 3 - 1) * 2520 / 7381)
    assert math.isclose(sum(h.values()), 1.0)


def test_trace_overrides_placement(tmp_path):
    trace = {"1.0": {"device": 0.5, "host": 0.25, "disk": 0.25}}
    p = tmp_path / "in.json"
    p.write_text(json.dumps({"trace": trace, "node": {"disk_read_gbps": 5.0}}))
    inp, over = cap.load_inputs(str(p))
    assert inp["node"]["disk_read_gbps"] == 5.0 and inp["node"]["gpus"] == 8
    sp = cap.spill(inp, M8, "bf16", 16, 1.0)
    rc = cap.request_cost(inp, M8, "bf16", 16)
    assert sp["from_trace"] and sp["hits"] == trace["1.0"]
    assert math.isclose(sp["t_load"], 0.5 * rc["t_device"] + 0.25 * rc["t_host"] + 0.25 * rc["t_disk"])
    best = min(rc["t_disk"], rc["t_prefill"], rc["t_hybrid"])
    assert math.isclose(sp["t_load_hybrid"], 0.5 * rc["t_device"] + 0.25 * rc["t_host"] + 0.25 * best)
    assert not cap.spill(inp, M8, "bf16", 16, 0.8)["from_trace"]
    assert "inputs file" in cap.markdown(inp, over)


def test_command_line(capsys):
    assert cap.main(["--markdown"]) == 0
    out = capsys.readouterr().out
    assert "### Users per node" in out and "| llama-70b | q4 | 64 |" in out
    assert cap.main(["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["models"]["llama-8b"][0]["page_bytes"] == 2_097_152
