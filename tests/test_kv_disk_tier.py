"""The KV cache's disk tier (--kv-offload-dir): the store's files, spill and restore on a tiny fake KV spec with
exact block ids, and through the engine: a prompt whose blocks left RAM, a restart, and the faults (a corrupt
file, another model's blocks, a full disk, a kill mid-write) never change a token."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from llmaccel.engine.kv_cache_manager import KVCacheManager
from llmaccel.engine.kv_tiers.disk import HEADER, DiskKVStore
from llmaccel.engine.kv_tiers.offload import KVOffload
from llmaccel.engine.request import Request
from llmaccel.llm import LLM
from llmaccel.sampling_params import SamplingParams
from tests.test_prefix_caching import _run_counting_tokens
from tests.tiny_models import hf_greedy

NAMESPACE = hashlib.sha256(b"test").digest()
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
ROOT = Path(__file__).resolve().parent.parent


def _hash(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def _files(store: DiskKVStore) -> list[Path]:
    return sorted(store.folder.glob("*/*"))


# ---- the store -------------------------------------------------------------------------------------
def test_blocks_come_back_after_a_restart_and_the_least_recently_used_leave_first(tmp_path):
    size = HEADER.size + 100
    store = DiskKVStore(tmp_path, NAMESPACE, capacity=3 * size)
    for i in range(3):
        assert store.store(_hash(i), bytes([i]) * 100)
        store.flush()
        time.sleep(0.01)  # distinct modification times: the order a restart restores
    assert not store.store(_hash(0), b"\0" * 100)  # stored already
    assert store.count_run([_hash(0), _hash(1), _hash(9), _hash(2)]) == 2
    assert [bytes(p) for p in store.load([_hash(0)], 100).result()] == [b"\0" * 100]  # 0 is now the most recent
    store.store(_hash(3), b"\3" * 100)
    store.flush()
    assert _hash(1) not in store and store.stats.evicted_files == 1  # the least recently used went
    store.close()

    again = DiskKVStore(tmp_path, NAMESPACE, capacity=3 * size)
    assert [again.count_run([_hash(i)]) for i in range(4)] == [1, 0, 1, 1]
    payloads = again.load([_hash(2), _hash(3), _hash(0)], 100).result()
    assert [bytes(p) for p in payloads] == [b"\2" * 100, b"\3" * 100, b"\0" * 100]
    assert (again.stats.files, again.stats.loaded_blocks, again.stats.rejected_files) == (3, 3, 0)


def _damage(path: Path, how: str, other: Path) -> None:
    data = bytearray(path.read_bytes())
    if how == "corrupt byte":
        data[HEADER.size + 50] ^= 1
        path.write_bytes(data)
    elif how == "truncated":
        path.write_bytes(data[:HEADER.size + 60])
    elif how == "too long":
        path.write_bytes(data + b"\0")
    elif how == "another block's file":
        shutil.copy(other, path)
    elif how == "header cut":
        path.write_bytes(data[:20])


@pytest.mark.parametrize("how", ["corrupt byte", "truncated", "too long", "another block's file", "header cut",
                                 "another model's file"])
def test_a_bad_file_is_deleted_and_never_used(tmp_path, how):
    store = DiskKVStore(tmp_path, NAMESPACE, capacity=1 << 20)
    for i in range(3):
        store.store(_hash(i), bytes([i + 1]) * 100)
    store.flush()
    target = store._path(_hash(1))
    if how == "another model's file":  # the same block hash, written by a store of another namespace
        other = DiskKVStore(tmp_path / "other", hashlib.sha256(b"other").digest(), capacity=1 << 20)
        other.store(_hash(1), bytes([2]) * 100)
        other.flush()
        shutil.copy(other._path(_hash(1)), target)
    else:
        _damage(target, how, store._path(_hash(2)))
    payloads = store.load([_hash(0), _hash(1), _hash(2)], 100).result()
    assert [bytes(p) for p in payloads] == [b"\1" * 100]  # the run ends at the bad file
    assert not target.exists() and _hash(1) not in store
    assert store.stats.rejected_files == 1
    assert store.count_run([_hash(0), _hash(1)]) == 1


def test_temporary_files_a_crash_left_are_deleted_at_start(tmp_path):
    store = DiskKVStore(tmp_path, NAMESPACE, capacity=1 << 20)
    store.store(_hash(0), b"x" * 100)
    store.flush()
    leftover = store._path(_hash(1)).with_name("cut-short.kv.123.tmp")
    leftover.parent.mkdir(exist_ok=True)
    leftover.write_bytes(b"half a block")
    again = DiskKVStore(tmp_path, NAMESPACE, capacity=1 << 20)
    assert not leftover.exists()
    assert again.stats.files == 1


KILLED_WRITER = """
import hashlib, sys
from llmaccel.engine.kv_tiers.disk import DiskKVStore
store = DiskKVStore(sys.argv[1], hashlib.sha256(b"test").digest(), capacity=1 << 40)
print("ready", flush=True)
i = 0
while True:
    store.store(hashlib.sha256(str(i).encode()).digest(), bytes([i % 251]) * (8 << 20))
    store.flush()
    i += 1
"""


def test_a_kill_during_writes_leaves_only_whole_blocks(tmp_path):
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], stdout=subprocess.PIPE,
                              cwd=ROOT)
    assert writer.stdout.readline().strip() == b"ready"
    time.sleep(1.5)
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    store = DiskKVStore(tmp_path, NAMESPACE, capacity=1 << 40)
    assert not list(store.folder.glob("*/*.tmp"))
    count = store.stats.files
    assert count >= 1
    hashes = [_hash(i) for i in range(count)]
    assert store.count_run(hashes) == count  # the files present are blocks 0..count-1, each whole
    payloads = store.load(hashes, 8 << 20).result()
    assert [bytes(p[:1]) for p in payloads] == [bytes([i % 251]) for i in range(count)]
    assert store.stats.rejected_files == 0


FULL_DISK = """
import hashlib, json, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
from llmaccel.llm import LLM
from llmaccel.sampling_params import SamplingParams
model, directory, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
llm = LLM(model, dtype="float32", num_kv_blocks=24, kv_offload_dir=directory)
params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts * 2, params)]
llm.close()
print(json.dumps({"tokens": tokens, "stats": llm.engine.kv_tier_stats["disk"]}))
"""


def test_a_full_disk_drops_blocks_and_serving_goes_on(tmp_path, llama_dir):
    import json

    prompts = _prompts(3, 150)
    run = subprocess.run([sys.executable, "-c", FULL_DISK, str(llama_dir), str(tmp_path), json.dumps(prompts)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    expected = [hf_greedy(llama_dir, p, 6) for p in prompts]
    assert result["tokens"] == expected * 2
    assert result["stats"]["store_errors"] > 0
    assert result["stats"]["stored_blocks"] == 0 and result["stats"]["files"] == 0
    assert "could not write a block" in run.stderr


# ---- spill and restore, exact block ids ----------------------------------------------------------
def _fake_tier(tmp_path, kv: KVCacheManager, num_slots: int) -> tuple[KVOffload, torch.Tensor]:
    slab = torch.arange(num_slots * 4, dtype=torch.float32).view(1, 2, num_slots, 1, 2)
    tier = KVOffload(DiskKVStore(tmp_path, NAMESPACE, 1 << 20), [slab], kv.block_size)
    kv.attach_tier(tier)
    return tier, slab


def _compute(kv: KVCacheManager, request: Request, num_new: int, cached=None) -> list[int]:
    blocks = kv.allocate_slots(request, num_new, cached)
    request.num_computed_tokens += num_new
    kv.cache_computed_blocks(request)
    return blocks


def test_an_evicted_block_is_spilled_and_a_returning_prompt_gets_it_back_in_free_blocks(tmp_path):
    kv = KVCacheManager(num_blocks=4, block_size=2)
    tier, slab = _fake_tier(tmp_path, kv, 8)
    a = Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4))
    assert _compute(kv, a, 5) == [0, 1, 2]
    kv.free(a)
    assert kv.pool.free_block_ids() == [2, 3, 1, 0]  # a's cached blocks 0 and 1 at the tail
    a_kv = slab[:, :, 0:4].clone()

    b = Request("b", [9] * 7, SamplingParams(max_tokens=4))
    assert kv.allocate_slots(b, 7) == [2, 3, 1, 0]  # a's blocks evicted: spilled before they are reused
    slab.fill_(-1.0)  # b writes its KV everywhere
    tier.store.flush()
    assert tier.store.count_run([a.block_hashes[0], a.block_hashes[1]]) == 2
    assert tier.store.stats.stored_blocks == 2
    kv.free(b)
    assert kv.pool.free_block_ids() == [0, 1, 3, 2]

    again = Request("a2", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4))
    cached = kv.find_cached_prefix(again)
    assert cached.loading and cached.blocks == []  # read on the store's thread; the request waits
    tier.loads["a2"].future.result()
    cached = kv.find_cached_prefix(again)
    assert not cached.loading and cached.blocks == [0, 1]  # copied into the free queue's head blocks
    assert torch.equal(slab[:, :, 0:4], a_kv)
    assert kv.pool.free_block_ids() == [3, 2, 1, 0]  # cached and free until the request takes them
    assert kv.allocate_slots(again, 1, cached) == [3]
    assert again.block_ids == [0, 1, 3] and again.num_computed_tokens == 4
    assert tier.restored_blocks == 2

    kv.free(again)  # evicting a block that came from disk writes nothing: the file is there
    kv.allocate_slots(Request("c", [7] * 8, SamplingParams(max_tokens=4)), 8)
    tier.store.flush()
    assert tier.store.stats.stored_blocks == 2


def _evict_a_prompt(kv: KVCacheManager) -> Request:
    """Compute prompt [1..5] and free it (two cached blocks), then hand every block to another request, which
    spills them; returns that request."""
    a = Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4))
    _compute(kv, a, 5)
    kv.free(a)
    hog = Request("hog", [9] * 8, SamplingParams(max_tokens=4))
    kv.allocate_slots(hog, 8)
    return hog


def test_a_load_that_finds_no_free_block_leaves_the_prompt_to_be_computed(tmp_path):
    kv = KVCacheManager(num_blocks=4, block_size=2)
    tier, _ = _fake_tier(tmp_path, kv, 8)
    _evict_a_prompt(kv)  # and keep every block
    again = Request("a2", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4))
    assert kv.find_cached_prefix(again).loading
    tier.loads["a2"].future.result()
    cached = kv.find_cached_prefix(again)
    assert not cached.loading and cached.blocks == []
    assert tier.restored_blocks == 0 and not tier.loads


def test_an_aborted_request_drops_its_load(tmp_path):
    kv = KVCacheManager(num_blocks=4, block_size=2)
    tier, _ = _fake_tier(tmp_path, kv, 8)
    kv.free(_evict_a_prompt(kv))
    again = Request("a2", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4))
    assert kv.find_cached_prefix(again).loading
    kv.free(again)
    assert not tier.loads


# ---- through the engine --------------------------------------------------------------------------
def _prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(length)] for _ in range(count)]


def _llm(model_dir, directory, **options) -> LLM:
    return LLM(str(model_dir), dtype="float32", num_kv_blocks=24, kv_offload_dir=str(directory), **options)


def test_a_prompt_whose_blocks_left_ram_is_read_back_and_answers_the_same(tmp_path, llama_dir):
    first, second, third = _prompts(3, 150)
    llm = _llm(llama_dir, tmp_path)
    assert _run_counting_tokens(llm, first) == (hf_greedy(llama_dir, first, 12), 150 + 11)
    _run_counting_tokens(llm, second)
    _run_counting_tokens(llm, third)  # 24 blocks hold two of these: the first's blocks were evicted, and spilled
    kv = llm.engine.kv_cache
    hashes = kv._block_hashes(Request("x", first, GREEDY), 9)
    in_ram = next(i for i, h in enumerate(hashes + [None]) if h is None or kv.pool.lookup(h) is None)
    assert in_ram < 9  # its deepest blocks went first
    tokens, computed = _run_counting_tokens(llm, first)
    assert tokens == hf_greedy(llama_dir, first, 12)
    assert computed == 150 - 144 + 11  # its 9 whole blocks came from RAM and disk
    stats = llm.engine.kv_tier_stats["disk"]
    assert stats["restored_blocks"] == 9 - in_ram and stats["rejected_files"] == 0
    assert llm.engine.num_free_blocks == llm.engine.num_blocks


def test_a_restarted_engine_finds_the_blocks_the_last_one_wrote(tmp_path, llama_dir):
    prompts = _prompts(2, 150, seed=1)
    with _llm(llama_dir, tmp_path) as llm:
        for prompt in prompts:
            _run_counting_tokens(llm, prompt)  # still in RAM at the end: close() writes them
    llm = _llm(llama_dir, tmp_path)
    for prompt in prompts:
        assert _run_counting_tokens(llm, prompt) == (hf_greedy(llama_dir, prompt, 12), 6 + 11)
    assert llm.engine.kv_tier_stats["disk"]["restored_blocks"] == 18
    cold = _llm(llama_dir, tmp_path / "empty")
    assert _run_counting_tokens(cold, prompts[0])[1] == 150 + 11


def test_corrupt_files_after_a_restart_are_computed_again(tmp_path, llama_dir):
    prompt = _prompts(1, 150, seed=2)[0]
    with _llm(llama_dir, tmp_path) as llm:
        _run_counting_tokens(llm, prompt)
    files = sorted(tmp_path.glob("*/*/*.kv"))
    assert len(files) == 10  # the prompt's 9 whole blocks and one of prompt and answer
    for path in files:
        data = bytearray(path.read_bytes())
        data[-7] ^= 0x40
        path.write_bytes(data)
    llm = _llm(llama_dir, tmp_path)
    assert _run_counting_tokens(llm, prompt) == (hf_greedy(llama_dir, prompt, 12), 150 + 11)
    assert llm.engine.kv_tier_stats["disk"]["rejected_files"] == 9  # the run's blocks are read together
    assert len(list(tmp_path.glob("*/*/*.kv"))) == 1  # the block past the prompt, never read
    assert llm.engine.kv_tier_stats["disk"]["restored_blocks"] == 0


def test_other_weights_at_the_same_path_never_read_the_old_blocks(tmp_path, tiny_model_dirs):
    """The same path, so the same variant and the same block hashes: only the namespace (the weights' files)
    tells the blocks apart, and a file moved into the new namespace's folder is refused by its header."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dirs["llama-gqa"], model)
    prompt = _prompts(1, 150, seed=3)[0]
    with _llm(model, tmp_path / "kv") as llm:
        _run_counting_tokens(llm, prompt)
    old_folder = llm.engine.kv_cache.tier.store.folder
    other = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    with torch.no_grad():
        for weight in other.parameters():
            weight.mul_(-1.5)
    time.sleep(0.01)
    other.save_pretrained(model)  # the same shapes and names, other values
    llm = _llm(model, tmp_path / "kv")
    new_folder = llm.engine.kv_cache.tier.store.folder
    assert new_folder != old_folder
    expected = hf_greedy(model, prompt, 12)
    assert _run_counting_tokens(llm, prompt) == (expected, 150 + 11)
    llm.close()
    shutil.rmtree(new_folder)
    shutil.copytree(old_folder, new_folder)  # the old blocks, under the new weights' namespace
    llm = _llm(model, tmp_path / "kv")
    assert _run_counting_tokens(llm, prompt) == (expected, 150 + 11)
    assert llm.engine.kv_tier_stats["disk"]["rejected_files"] == 9  # each refused by its header's namespace


def test_engines_sharing_a_directory_write_through_find_each_others_blocks(tmp_path, llama_dir):
    """Two replicas' engines on one directory: with write-through, what one computed the other reads, while the
    first still holds it in RAM (with the default policy nothing is on disk yet)."""
    prompt = _prompts(1, 150, seed=5)[0]
    evicting, reader = _llm(llama_dir, tmp_path / "evict"), _llm(llama_dir, tmp_path / "evict")
    _run_counting_tokens(evicting, prompt)
    assert _run_counting_tokens(reader, prompt)[1] == 150 + 11
    first = _llm(llama_dir, tmp_path / "shared", kv_offload_policy="write-through")
    second = _llm(llama_dir, tmp_path / "shared", kv_offload_policy="write-through")
    expected = hf_greedy(llama_dir, prompt, 12)
    assert _run_counting_tokens(first, prompt) == (expected, 150 + 11)
    first.engine.kv_cache.tier.store.flush()
    assert _run_counting_tokens(second, prompt) == (expected, 6 + 11)
    assert second.engine.kv_tier_stats["disk"]["restored_blocks"] == 9
    assert 0.0 < second.engine.kv_cache.tier.block_value() <= 1.0  # what the router weighs a shared block by
    assert first.engine.kv_cache.tier.block_value() is None  # it has read nothing yet
    assert first.engine.kv_tier_stats["disk"]["stored_blocks"] == 10  # written as computed, answer included


def test_bad_disk_tier_settings_are_named_errors(tmp_path, llama_dir):
    with pytest.raises(ValueError, match="needs prefix caching"):
        LLM(str(llama_dir), kv_offload_dir=str(tmp_path), enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offload_policy"):
        LLM(str(llama_dir), kv_offload_dir=str(tmp_path), kv_offload_policy="sometimes")
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(ValueError, match="--kv-offload-dir .*a-file: cannot use it"):
        LLM(str(llama_dir), kv_offload_dir=str(tmp_path / "a-file"))


def test_spilled_blocks_do_not_hold_the_step_nor_leak_staged_reads(tmp_path, llama_dir):
    """Eight prompts through a pool that holds two, twice: every read is taken into the pool or dropped."""
    prompts = _prompts(8, 150, seed=4)
    llm = _llm(llama_dir, tmp_path)
    expected = [hf_greedy(llama_dir, p, 6) for p in prompts]
    for _ in range(2):
        assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY)] == expected
    assert not llm.engine.kv_cache.tier.loads
    assert llm.engine.kv_tier_stats["disk"]["restored_blocks"] > 0
    assert llm.engine.num_free_blocks == llm.engine.num_blocks
    llm.close()
    assert os.listdir(tmp_path)


# ---- the server ----------------------------------------------------------------------------------
def test_a_restarted_server_answers_a_returning_chat_from_disk_with_the_same_text(tmp_path, llama_dir):
    from openai import OpenAI

    from tests.live_server import MODEL_NAME, live_server, scrape

    options = {"dtype": "float32", "num_kv_blocks": 64, "kv_offload_dir": str(tmp_path)}
    messages = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 20}]
    answers = []
    for _ in range(2):
        with live_server(llama_dir, engine_options=options) as server:
            client = OpenAI(base_url=server.url + "/v1", api_key="none")
            reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0)
            answers.append((reply.choices[0].message.content, reply.usage.prompt_tokens_details))
            samples = scrape(server.url)
            stats = httpx.get(server.url + "/v1/llmaccel/stats").json()["kv_tiers"]["disk"]
    assert answers[0][0] == answers[1][0]
    assert answers[1][1].cached_tokens >= 160  # the restarted server read the chat's blocks back
    assert samples["llmaccel_kv_tier_restored_blocks_total"][(("tier", "disk"),)] >= 10
    assert stats["files"] >= 10 and stats["rejected_files"] == 0 and stats["mean_load_ms"] is not None
