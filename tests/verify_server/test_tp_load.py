"""Tensor parallel loads only its slices: a rank reads its shard of each projection from the safetensors files,
so its memory while loading stays well under the whole checkpoint, and what it holds is what cutting the whole
model would have left."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.model

MEASURE = textwrap.dedent("""
    import json, sys, threading, time
    from pathlib import Path
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from verify_server.tensor_parallel import load_shard

    def rss():  # resident memory: what the process allocated and the pages of files it has mapped
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024

    folder, how = Path(sys.argv[1]), sys.argv[2]
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):  # the libraries' own first-use pages, before the baseline
        AutoModelForCausalLM.from_config(config)
    torch.zeros(64, 64)[:, 3:9].contiguous().copy_(torch.ones(64, 6))
    base, peak, done = rss(), [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    if how == "shard":
        model = load_shard(folder, config, torch.float32, 1, 4)
    else:  # the whole model, every weight read once (as moving it to a GPU or packing it would)
        model = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32)
        sum(float(p.sum()) for p in model.parameters())
    done.set()
    watcher.join()
    peak[0] = max(peak[0], rss())
    print(json.dumps({"peak": peak[0] - base, "params": sum(p.numel() * 4 for p in model.parameters())}))
""")


def test_a_rank_reads_its_slices_only(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from verify_server.tensor_parallel import load_shard, shard_model

    config = AutoConfig.for_model("llama", vocab_size=4096, hidden_size=512, intermediate_size=2048,
                                  num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                                  tie_word_embeddings=False)
    torch.manual_seed(0)
    whole = AutoModelForCausalLM.from_config(config).eval()
    whole.save_pretrained(tmp_path)
    size = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    assert size > 140e6
    # what rank 1 of 4 holds is the whole model cut by shard_model
    shard = load_shard(tmp_path, AutoConfig.from_pretrained(tmp_path), torch.float32, 1, 4)
    shard_model(whole, 1, 4)
    got, want = shard.state_dict(), whole.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    del whole, shard

    def measure(how):
        done = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path), how], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    sliced, full = measure("shard"), measure("whole")
    assert full["peak"] >= 0.9 * size  # the measure sees a whole load: every page of the checkpoint resident
    # a quarter of each layer, the embeddings and logits projection whole: about a third of the checkpoint
    assert sliced["params"] < 0.4 * size
    assert sliced["peak"] < 0.5 * size, (sliced, size)
