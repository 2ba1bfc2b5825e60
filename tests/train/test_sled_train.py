"""sled-train's parts on a tiny random Llama: the graphs the device runs match what was trained, the trainer is
seeded and resumes exactly, and bad settings are refused before any work."""

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch

from sled_train import data as D
from sled_train.cli import main, parse
from sled_train.graph import write_onnx
from sled_train.heads import ImitationHead, ParallelHead, ctc_collapse
from sled_train.train import runs, summarize, train

IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11, 30, 412, 77]


def hidden_of(model, ids, layers=1):
    with torch.inference_mode():
        return model(torch.tensor([ids]), output_hidden_states=True).hidden_states[layers]


def empty_cache(graph, past=0):
    return torch.zeros(len(graph.blocks), 1, graph.kv_heads, past, graph.head_dim)


def test_a_slot_sees_the_context_up_to_its_anchor_and_its_own_slots_only():
    allowed = ParallelHead.mask(torch.tensor([[1, 3]]), t=5, s=2)[0, 0] == 0
    assert allowed[:5, :5].equal(torch.ones(5, 5, dtype=torch.bool).tril())  # the context is causal
    assert not allowed[:5, 5:].any()  # and never sees a slot
    assert allowed[5:7, :2].all() and not allowed[5:7, 2:5].any()  # anchor 1's slots: context 0..1
    assert allowed[7:9, :4].all() and not allowed[7:9, 4].any()  # anchor 3's slots: context 0..3
    assert allowed[5:7, 5:7].all() and allowed[7:9, 7:9].all()  # each anchor's slots see each other
    assert not allowed[5:7, 7:9].any() and not allowed[7:9, 5:7].any()


def test_imitation_graph_computes_what_was_trained(tiny):
    head = ImitationHead(tiny.model, 1, 1).eval()
    with torch.no_grad():
        head.blocks[0].o.weight.add_(torch.randn_like(head.blocks[0].o.weight) * 0.05)  # as if trained
        want = head.logits(head(hidden_of(tiny.model, IDS)))[0]
        graph = head.graph(tiny.model).eval()
        first, keys, values = graph(torch.tensor([IDS[:5]]), empty_cache(graph), empty_cache(graph))
        rest, _, _ = graph(torch.tensor([IDS[5:]]), keys, values)  # the rest from the cache
    assert torch.allclose(torch.cat([first[0], rest[0]]), want, atol=1e-4)


@pytest.mark.parametrize("blank", [False, True])
def test_parallel_graph_computes_what_was_trained_with_the_cache(tiny, blank):
    head = ParallelHead(tiny.model, 1, 1, slots=3, blank=blank, seed=0).eval()
    with torch.no_grad():
        head.slot_maps.normal_(0, 0.05)  # as if trained
        hidden = hidden_of(tiny.model, IDS)
        want = head.slot_logits(head(hidden, torch.tensor([[len(IDS) - 1, 6]]))[0])[0]  # two anchors
        graph = head.graph(tiny.model).eval()
        _, keys, values = graph(torch.tensor([IDS[:4]]), empty_cache(graph), empty_cache(graph))
        got, keys, _ = graph(torch.tensor([IDS[4:]]), keys, values)
        at6, _, _ = graph(torch.tensor([IDS[:7]]), empty_cache(graph), empty_cache(graph))
    assert got.shape == (1, 3, tiny.vocab_size + blank)
    assert keys.shape[3] == len(IDS)  # the slots leave nothing in the cache
    assert torch.allclose(got[0], want[0], atol=1e-4)
    assert torch.allclose(at6[0], want[1], atol=1e-4)


def test_the_parallel_onnx_model_matches_torch_for_any_token_and_cache_length(tiny, tmp_path):
    head = ParallelHead(tiny.model, 1, 1, slots=4, blank=True, seed=1).eval()
    with torch.no_grad():
        head.slot_maps.normal_(0, 0.05)
    graph = head.graph(tiny.model).eval()
    write_onnx(graph, tmp_path / "p.onnx", ("slot_logits", "present_keys", "present_values"), False, log=lambda m: None)
    s = ort.InferenceSession(str(tmp_path / "p.onnx"))
    keys = values = empty_cache(graph).numpy()
    with torch.no_grad():
        for chunk in (IDS[:7], IDS[7:8], IDS[8:]):
            want, _, _ = graph(torch.tensor([chunk]), torch.from_numpy(keys), torch.from_numpy(values))
            got, keys, values = s.run(None, {"input_ids": np.asarray([chunk]), "past_keys": keys,
                                             "past_values": values})
            assert np.allclose(got, want.numpy(), atol=1e-4)
    assert keys.shape[3] == len(IDS)


def test_the_imitation_loss_reads_the_answers_rows_only(tiny):
    from argparse import Namespace

    from sled_train.train import step_loss

    t, prompt_len, top = len(IDS), 5, 4
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(t, top, generator=g)
    feats = D.Features(torch.tensor(IDS), prompt_len, hidden_of(tiny.model, IDS)[0],
                       torch.randint(tiny.vocab_size, (t, top), generator=g), probs / probs.sum(-1, keepdim=True),
                       torch.zeros(t, tiny.model.config.hidden_size).half())
    head, args = ImitationHead(tiny.model, 1, 1), Namespace(kind="imitation", hidden_weight=0.0)

    def loss_with(rows):
        changed = D.Features(**{**feats.__dict__, "top_ids": feats.top_ids.clone()})
        changed.top_ids[rows] = (changed.top_ids[rows] + 1) % tiny.vocab_size
        with torch.no_grad():
            return step_loss(args, head, [changed], 0, "cpu")

    base = loss_with([])
    assert torch.equal(loss_with(list(range(prompt_len - 1))), base)  # the prompt's rows: a device never drafts there
    assert not torch.equal(loss_with([prompt_len - 1]), base)  # the prompt's last row predicts the answer's first token
    assert not torch.equal(loss_with([t - 1]), base)


def test_ctc_collapse_merges_repeats_then_drops_blanks():
    assert ctc_collapse([5, 5, 9, 7, 9, 9, 3], blank=9) == [5, 7, 3]
    assert ctc_collapse([5, 9, 5], blank=9) == [5, 5]  # a blank between repeats keeps both


def test_acceptance_counts_the_run_a_greedy_verifier_keeps():
    kept = runs([[1, 2, 3], [1, 9, 3], [7]], [[1, 2, 3], [1, 2, 3], [1, 2]])
    assert kept == [3, 1, 0]
    assert summarize(kept, 3) == {"anchors": 3, "mean_acceptance_length": 1 + 4 / 3,
                                  "acceptance_by_position": [2 / 3, 1 / 3, 1 / 3]}


def test_chat_prompts_are_built_from_the_vocabulary_and_are_none_of_the_benchmarks(tiny):
    from bench.drafters import EDIT, FREE, REPETITIVE

    chat = D.chat_prompts(tiny.vocab_tokens)
    assert len(chat) == D.CHAT_COUNT == len(set(chat)) and chat == D.chat_prompts(tiny.vocab_tokens)
    assert not set(chat) & set(EDIT + FREE + REPETITIVE)
    with pytest.raises(ValueError, match="unknown corpus 'wiki'"):
        D.corpus(["humaneval", "wiki"])


def test_held_out_prompts_never_reach_training_whatever_the_counts(tiny):
    prompts = D.corpus(["humaneval", "pydoc", "chat"], tiny.vocab_tokens)
    assert len(prompts) > 600
    for n, seed in ((20, 0), (200, 3)):
        train_p, eval_p = D.split(prompts, 0.1, n, 10, seed)
        assert len(train_p) == n and len(eval_p) == 10
        assert not set(train_p) & {p for p in prompts if D.held_out(p, 0.1)}
        assert all(D.held_out(p, 0.1) for p in eval_p)


def argv(tmp_path, kind="imitation", *more):
    return [kind, "--target", "random:llama-tiny", "--layers", "1", "--prompts", "3", "--eval-prompts", "1",
            "--max-new-tokens", "12", "--steps", "4", "--batch", "2", "--save-every", "2",
            "--output", str(tmp_path / f"{kind}.onnx"), "--work", str(tmp_path / "work"), *more]


@pytest.mark.parametrize("kind,more", [("imitation", ["--hidden-weight", "0.5"]), ("parallel", ["--loss", "ctc"])])
def test_an_interrupted_run_resumes_to_the_same_weights_as_one_straight_through(tiny, tmp_path, monkeypatch, kind,
                                                                                 more):
    straight = tmp_path / "straight"
    train(parse(argv(straight, kind, *more)), tiny)
    want = torch.load(straight / "work" / f"{kind}.checkpoint.pt", weights_only=False)

    broken = tmp_path / "broken"
    calls = {"n": 0}
    real_step = torch.optim.AdamW.step

    def step_then_fail(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", step_then_fail)
    with pytest.raises(KeyboardInterrupt):
        train(parse(argv(broken, kind, *more)), tiny)
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)
    with pytest.raises(ValueError, match="--resume"):  # nothing is overwritten without it
        train(parse(argv(broken, kind, *more)), tiny)
    interrupted = torch.load(broken / "work" / f"{kind}.checkpoint.pt", weights_only=False)
    report = train(parse(argv(broken, kind, *more, "--resume")), tiny)
    # the card's training time counts the interrupted run's steps too
    assert report["train"]["seconds"] > interrupted["seconds"] > 0
    got = torch.load(broken / "work" / f"{kind}.checkpoint.pt", weights_only=False)
    assert got["step"] == want["step"] == 4 and got["losses"] == want["losses"]
    for name, tensor in want["head"].items():
        assert torch.equal(got["head"][name], tensor), name
    meta = json.loads((broken / f"{kind}.json").read_text())
    assert meta["kind"] == ("parallel" if kind == "parallel" else "autoregressive")
    held = meta["held_out_prompts"]  # named for sled-bench even when the data was reused
    assert len(held) == 1 and all(D.held_out(p, 0.1) for p in held)
    card = (broken / f"{kind}.md").read_text()
    assert "held-out acceptance" in card and "random:llama-tiny" in card
    assert "distilled data reused from the work folder" in card  # the resumed run distilled nothing
    if kind == "imitation":
        assert "untrained early exit" in card
    else:
        assert meta["slots"] == 6 and meta["blank_id"] == tiny.vocab_size


def test_a_torn_data_file_is_distilled_again_not_trusted(tiny, tmp_path):
    args = parse(argv(tmp_path))
    first = train(args, tiny)["data"]
    path = tmp_path / "work" / f"data-{first['key']}.pt"
    path.write_bytes(b"not a torch file")
    args = parse(argv(tmp_path, "imitation", "--resume"))
    assert train(args, tiny)["data"]["key"] == first["key"]
    assert torch.load(path, weights_only=False)["key"] == first["key"]


@pytest.mark.parametrize("extra,message", [
    (["--loss", "ce", "--slots", "6"], "--slots must be --heads"),
    (["--loss", "ctc", "--slots", "3"], "must be at least --heads"),
    (["--heads", "1"], "--heads must be at least 2"),
])
def test_slot_settings_that_clash_are_refused(tmp_path, capsys, extra, message):
    assert main(argv(tmp_path, "parallel", *extra)) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "work").exists()


def test_bad_paths_and_counts_are_clear_errors(tmp_path, capsys):
    assert main(argv(tmp_path) + ["--output", str(tmp_path / "model.bin")]) == 2
    assert "--output must name an .onnx file" in capsys.readouterr().err
    assert main(argv(tmp_path) + ["--resume"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(argv(tmp_path) + ["--layers", "3"]) == 2
    assert "--layers must be in 1..2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(argv(tmp_path) + ["--steps", "0"])
    assert "must be above 0" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["imitation", "parallel"])
def test_every_command_has_help(capsys, kind):
    with pytest.raises(SystemExit) as done:
        main([kind, "--help"])
    assert done.value.code == 0 and "--output" in capsys.readouterr().out


def test_a_parallel_head_starts_from_an_imitation_checkpoint_of_the_same_shape(tiny, tmp_path):
    from sled_train.train import start_from

    train(parse(argv(tmp_path)), tiny)
    ckpt = tmp_path / "work" / "imitation.checkpoint.pt"
    head = ParallelHead(tiny.model, 1, 1, slots=4, blank=False, seed=0)
    start_from(head, ckpt, parse(argv(tmp_path, "parallel")))
    saved = torch.load(ckpt, weights_only=False)["head"]
    assert all(torch.equal(head.state_dict()[k], v) for k, v in saved.items() if k.startswith("blocks."))
    with pytest.raises(ValueError, match="--head-layers 2"):
        start_from(ParallelHead(tiny.model, 1, 2, slots=4, blank=False, seed=0), ckpt,
                   parse(argv(tmp_path, "parallel", "--head-layers", "2")))


def test_a_parallel_heads_first_slot_is_the_imitation_heads_token_at_its_anchor(tiny):
    imitation = ImitationHead(tiny.model, 1, 1).eval()
    with torch.no_grad():
        imitation.blocks[0].o.weight.add_(torch.randn_like(imitation.blocks[0].o.weight) * 0.05)  # as if trained
    head = ParallelHead(tiny.model, 1, 1, slots=3, blank=False, seed=0).eval()
    head.load_state_dict(imitation.state_dict(), strict=False)
    anchors = torch.tensor([[4, 9]])
    with torch.no_grad():
        hidden = hidden_of(tiny.model, IDS)
        slots, context = head(hidden, anchors)
        want = imitation.logits(imitation(hidden))[0, anchors[0]]
    assert torch.allclose(head.slot_logits(slots)[0, :, 0], want, atol=1e-4)
    assert torch.allclose(head.logits(context)[0, anchors[0]], want, atol=1e-4)
    assert not torch.allclose(head.slot_logits(slots)[0, :, 1], want, atol=1e-2)  # the other slots are their own


def test_a_backbone_must_share_the_targets_tokenizer(tiny, tmp_path, monkeypatch):
    report = train(parse(argv(tmp_path, "imitation", "--backbone", "random:llama-tiny")), tiny)
    assert report["held_out"]["anchors"] > 0
    import verify_server.model_loader as loader

    real = loader.load_target

    def other_vocab(path, *a, **k):
        made = real(path, *a, **k)
        made.fingerprint = "sha256:another"
        return made

    monkeypatch.setattr(loader, "load_target", other_vocab)
    with pytest.raises(ValueError, match="another tokenizer"):
        train(parse(argv(tmp_path / "b", "imitation", "--backbone", "random:llama-tiny")), tiny)


def test_steps_and_rate_default_by_kind_and_yield_to_the_command_line():
    from sled_train.cli import KIND_DEFAULTS

    for kind in ("imitation", "parallel"):
        args = parse([kind, "--output", "d.onnx"])
        assert (args.steps, args.lr) == (KIND_DEFAULTS[kind]["steps"], KIND_DEFAULTS[kind]["lr"])
        given = parse([kind, "--output", "d.onnx", "--steps", "7", "--lr", "0.5"])
        assert (given.steps, given.lr) == (7, 0.5)
