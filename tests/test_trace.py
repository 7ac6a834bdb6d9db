"""`kvbench trace`: Mooncake JSONL traces read and checked, prefix-cache hits replayed exactly, bytes per model."""
import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from kvbench.cli.main import main
from kvbench.model import shapes as M
from kvbench.model import trace as T

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "data" / "mooncake-fast25"  # the unchanged copies, where a checkout has them
LLAMA3_8B_B_PER_TOKEN = 32 * 2 * 8 * 128 * 2  # layers x (K, V) x KV heads x head dim x fp16 bytes = 131,072


def write(tmp_path, reqs, name="t.jsonl") -> str:
    """reqs: (timestamp ms, input tokens, output tokens, hash ids)."""
    path = tmp_path / name
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": i, "output_length": o, "hash_ids": h}) + "\n"
                            for t, i, o, h in reqs))
    return str(path)


# A..E: B shares A's two leading blocks, C shares one; D's two fresh blocks push 1 and 2 out of a 2-block LRU,
# so E, a repeat of that head, hits under an unbounded cache and misses under the LRU
HAND = [(0, 1536, 10, [1, 2, 3]), (1000, 1536, 10, [1, 2, 4]), (2000, 1024, 10, [1, 5]),
        (3000, 1024, 10, [6, 7]), (4000, 1024, 10, [1, 2])]


def test_shared_prefixes_and_an_lru_eviction_give_exact_hits(tmp_path):
    tr = T.read(write(tmp_path, HAND))
    assert (tr.requests, tr.duration_s, len(tr.ids)) == (5, 4.0, 12)
    unbounded = T.replay(tr)
    assert unbounded.hit_blocks.tolist() == [0, 2, 1, 0, 2]
    # LRU of 2, a request's blocks touched tail first: after A the cache holds its head [2, 1] (not [2, 3]),
    # so B hits both; D's 7 and 6 then evict 1 and 2, and E finds nothing
    lru = T.replay(tr, 2)
    assert lru.hit_blocks.tolist() == [0, 2, 1, 0, 0]
    assert (lru.blocks, int(lru.hit_blocks.sum()), lru.block_hit_rate) == (12, 3, 3 / 12)
    assert (lru.tokens, lru.hit_tokens, lru.moved_tokens) == (6144, 1536, 4608)
    assert T.replay(tr, 12).hit_blocks.tolist() == unbounded.hit_blocks.tolist()  # room for all: nothing evicted


def test_hit_tokens_stop_at_the_prompt_when_the_last_block_is_partial(tmp_path):
    tr = T.read(write(tmp_path, [(0, 1000, 1, [1, 2]), (1, 1000, 1, [1, 2]), (2, 700, 1, [1, 2]),
                                 (3, 1500, 1, [1, 2, 3])]))
    s = T.replay(tr)
    assert s.hit_blocks.tolist() == [0, 2, 2, 2]
    # min(2 x 512, 1000) = 1000, min(1024, 700) = 700, min(1024, 1500) = 1024
    assert (s.tokens, s.hit_tokens, s.moved_tokens) == (4200, 2724, 1476)
    assert s.token_hit_rate == 2724 / 4200


def test_other_block_sizes_by_flag(tmp_path):
    path = write(tmp_path, [(0, 40, 1, [7, 8, 9]), (5, 33, 1, [7, 8, 9])])
    s = T.replay(T.read(path, block=16))
    assert (s.hit_blocks.tolist(), s.hit_tokens) == ([0, 3], 33)  # min(3 x 16, 33)
    with pytest.raises(T.TraceError, match="3 hash ids for 40 tokens.*--trace-block"):
        T.read(path)  # at 512 tokens a block, 40 tokens fill one block, not three


def test_the_bytes_that_move_for_a_model(tmp_path, capsys):
    assert main(["trace", write(tmp_path, HAND), "-m", "llama-3-8b", "--cache-blocks", "unbounded,2"]) == 0
    out = capsys.readouterr().out
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines() if "llama-3-8b" in ln and not ln.startswith("#")}
    # unbounded: 6144 - (1024 + 512 + 1024) = 3584 tokens move; LRU of 2: 4608
    assert rows["unbounded"][2:4] == [f"{LLAMA3_8B_B_PER_TOKEN:,}", f"{3584 * LLAMA3_8B_B_PER_TOKEN:,}"]
    assert rows["2"][2:4] == [f"{LLAMA3_8B_B_PER_TOKEN:,}", f"{4608 * LLAMA3_8B_B_PER_TOKEN:,}"]
    assert "5 requests" in out and "4.000 s duration" in out and "1.250 req/s arrival rate" in out


@pytest.mark.parametrize("model", ["gpt-oss-120b", "qwen3-next-80b-a3b"])
def test_a_hybrid_models_bytes_count_its_windows_and_states_per_request(tmp_path, capsys, model):
    """B moved is each request's bytes as `kvbench size` counts them (M.request_bytes), summed: a sliding layer's
    window and a linear layer's state are per request, not tokens x B/token."""
    tr = T.read(write(tmp_path, HAND))
    hit = T.replay(tr).hit_tokens_each(tr.input_len)
    m = M.get_model(model)
    want = sum(M.request_bytes(m, "fp16", int(n), int(h)) for n, h in zip(tr.input_len, hit))
    assert want != int((tr.input_len - hit).sum()) * M.bytes_per_token(m, "fp16")  # the two differ here
    assert main(["trace", write(tmp_path, HAND), "-m", model]) == 0
    row = next(ln.split() for ln in capsys.readouterr().out.splitlines() if model in ln and not ln.startswith("#"))
    assert row[3] == f"{want:,}"


@pytest.mark.parametrize("name, requests, duration_s, blocks", [
    ("mooncake-conversation", 12_031, 3536.999, 288_500),
    ("mooncake-synthetic", 3_993, 1022.025, 121_877),
])
def test_the_shipped_traces_read_back_whole(name, requests, duration_s, blocks):
    tr = T.read(name)
    assert (tr.requests, tr.duration_s, len(tr.ids)) == (requests, duration_s, blocks)
    assert (T.HERE / "LICENSE-APACHE").is_file() and "Apache" in (T.HERE / "NOTICE").read_text()
    original = SHARED / T.NAMED[name].removesuffix(".gz")
    if original.is_file():  # shipped gzipped, otherwise unchanged
        assert gzip.decompress(T.resolve(name).read_bytes()) == original.read_bytes()


def test_the_vectorised_unbounded_cache_is_the_lru_with_room_for_everything():
    tr = T.read("mooncake-synthetic")
    assert np.array_equal(T.hits_unbounded(tr), T.hits_lru(tr, len(tr.ids)))


def test_the_conversation_trace_with_a_model(capsys):
    assert main(["trace", "mooncake-conversation", "-m", "llama-3-8b", "--cache-blocks", "unbounded,20000"]) == 0
    out = capsys.readouterr().out
    assert "          12,031 requests" in out
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines() if "llama-3-8b" in ln and not ln.startswith("#")}
    assert rows["unbounded"][3] == f"{90_695_412 * LLAMA3_8B_B_PER_TOKEN:,}"
    assert rows["20,000"][3] == f"{102_300_417 * LLAMA3_8B_B_PER_TOKEN:,}"


def test_help_says_what_each_number_means(capsys):
    with pytest.raises(SystemExit):
        main(["trace", "--help"])
    out = capsys.readouterr().out
    for word in ("requests", "duration", "arrival rate", "p50/p90/p99", "hit blocks", "block hit %", "hit tokens",
                 "token hit %", "min(hit blocks x block", "tokens moved", "B/token", "B moved", "GB/s",
                 "mooncake-conversation"):
        assert word in out, word


BAD_LINES = {
    "not JSON": ('{"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": [1]}\n{oops\n', ":2: not JSON"),
    "no hash_ids": ('{"timestamp": 0, "input_length": 9, "output_length": 1}\n', ":1: no hash_ids"),
    "negative length": ('{"timestamp": 0, "input_length": -9, "output_length": 1, "hash_ids": []}\n',
                        ":1: 'input_length' is -9, not a non-negative integer"),
    "backwards": ('{"timestamp": 5, "input_length": 9, "output_length": 1, "hash_ids": [1]}\n'
                  '{"timestamp": 4, "input_length": 9, "output_length": 1, "hash_ids": [1]}\n', ":2: timestamp 4 ms"),
    "empty": ("\n", "no requests"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_a_bad_trace_line_is_one_line_and_exit_1(tmp_path, capsys, case):
    text, said = BAD_LINES[case]
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    assert main(["trace", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and said in err, err


def test_a_damaged_gzip_trace_is_one_line_and_exit_1(tmp_path, capsys):
    data = bytearray(T.resolve("mooncake-synthetic").read_bytes()[:4000])
    data[2000:2100] = bytes(100)  # a hole in the deflate stream, and the end cut off
    path = tmp_path / "damaged.jsonl.gz"
    path.write_bytes(bytes(data))
    assert main(["trace", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "unreadable" in err, err


@pytest.mark.parametrize("args, said", [
    (["no/such/trace.jsonl"], "no such file"),
    (["mooncake-synthetic", "--cache-blocks", "0"], "'0' is not a positive number of blocks"),
    (["mooncake-synthetic", "--cache-blocks", "-1"], "'-1' is not a positive number of blocks"),
    (["mooncake-synthetic", "-m", "llama-9"], "model 'llama-9' is not one of"),
    (["mooncake-synthetic", "--trace-block", "0"], "'0' is not a positive number of tokens"),
])
def test_bad_arguments_are_one_line_and_exit_1(capsys, args, said):
    assert main(["trace", *args]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and said in err, err
